"""Build the small hybrid models the hybrid tests, the demo's variant and the benchmarks serve.

``python -m vllm_affinity build-model --arch ARCH`` builds them, for vLLM's hybrid KV cache
(one KV-cache group per kind of layer, all in one block pool), each as small as the ``tiny``
Llama and with random weights too: ``gpt-oss`` (sliding-window and full attention alternating,
experts; gpt-oss's own tokenizer, rebuilt offline from the harmony library vLLM renders its
chats with), ``gemma3`` (three sliding-window layers to one full), ``mistral`` (every layer
a sliding window, as Mistral 7B v0.1: one group, vLLM's unitary coordinator),
``qwen3-next`` (Gated DeltaNet linear attention and full attention alternating, experts) and
``linear-only`` (Qwen3-Next's layers, every one linear attention: one Mamba-kind group), the
last four with the Llama model's tokenizer and template. Besides them ``deepseek-v3``:
DeepSeek V3's Multi-head Latent Attention (one latent KV cache per token and layer, vLLM's
``mla_attention`` group: not hybrid, one group, but a KV cache of another kind), experts, the
Llama tokenizer too. Their folders:
``.cache/tiny-gpt-oss``, ``.cache/tiny-gemma3``, ``.cache/tiny-mistral``,
``.cache/tiny-qwen3-next``, ``.cache/tiny-linear-only``, ``.cache/tiny-deepseek-v3``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .tiny_model import DEFAULT_DIR, RECIPE_VERSION, _bpe_tokenizer

#: Bump when the hybrid models' recipe changes beyond ``HYBRID_SHAPES`` (tokenizers, templates).
HYBRID_RECIPE_VERSION = 1

#: gpt-oss's vocabulary: o200k_harmony's 199998 byte-pair tokens, then its special tokens
#: (``<|startoftext|>`` … ``<|channel|>``, ``<|start|>`` … ``<|reserved_201087|>``).
HARMONY_VOCAB = 201088
#: o200k's pre-tokenizer split (tiktoken's ``o200k_base`` pattern, gpt-oss's tokenizer's too).
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

#: The hybrid architectures ``--arch`` builds besides Llama, each in a folder of its own, as
#: ``transformers`` config arguments (the tokenizer's ids and the positions are added at build
#: time). Each shape is in its recipe stamp: changing one rebuilds that model only. Layers mix
#: attention kinds so that vLLM makes one KV-cache group per kind; widths stay small (a 4k-token
#: prefill is cheap on a CPU), head sizes stay ones the CPU kernels take (64).
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    # Sliding and full attention alternating (as in gpt-oss, and as vLLM's gpt-oss model assumes
    # whatever ``layer_types`` says), a few experts. The vocabulary is gpt-oss's: vLLM renders
    # its chats with the harmony library, whose token ids go up to 201087.
    "gpt-oss": {
        "vocab_size": HARMONY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # Three sliding-window layers to one global one (Gemma 3 has five to one).
    "gemma3": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
    # Every layer a sliding window (Mistral 7B v0.1's shape: ``sliding_window`` and no
    # ``layer_types``): one KV-cache group, so vLLM builds its unitary coordinator, not the
    # hybrid one, and vLLM's default retention keeps the window's state at prompt ends and
    # junctions only, as beside full attention.
    "mistral": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 128,
    },
    # Gated DeltaNet linear attention with full attention every second layer, a few experts.
    # The linear-attention head sizes must be 64: vLLM's CPU kernel rejects 32 ("Unexpected head
    # dim size").
    "qwen3-next": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
    # Every layer Gated DeltaNet linear attention (no full attention): one KV-cache group of
    # Mamba kind, so vLLM builds its unitary coordinator over Mamba state alone.
    "linear-only": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "layer_types": ["linear_attention"] * 2,
    },
    # Multi-head Latent Attention (DeepSeek V2/V3, Kimi K2): one dense layer, then one with
    # experts (DeepSeek V3's sigmoid router with its bias). vLLM's CPU MLA kernels take only
    # DeepSeek's latent width, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576 (their
    # only head size); the per-head widths are free. Without AMX (vLLM's AMX_MLA backend) vLLM
    # 0.32 serves it with its reference CPU_MLA backend, at block size 16 whatever
    # ``--block-size`` says, and with prefix caching and chunked prefill off
    # (``CpuPlatform.check_and_update_config``).
    "deepseek-v3": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    },
}
HYBRID_DIRS = {arch: DEFAULT_DIR.with_name(f"tiny-{arch}") for arch in HYBRID_SHAPES}

#: gpt-oss's chat template, for what vLLM renders with its chat template rather than with harmony
#: (``/tokenize`` with messages: without a template it fails): the prompt vLLM's chat endpoint
#: renders with harmony, token for token, for text chats with tool calls and tool results
#: (vLLM 0.32). Not covered: a request's ``tools`` (refused here), text given as several content
#: parts (harmony encodes each part apart), ``VLLM_SYSTEM_START_DATE`` (the date here is today's).
GPT_OSS_CHAT_TEMPLATE = (
    "{%- if tools %}{{ raise_exception('the tiny gpt-oss template does not render tool"
    " definitions: vLLM renders them with harmony') }}{% endif %}"
    "{%- macro text(content) %}{% if content is string %}{{ content }}"
    "{%- elif content %}{% for part in content %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{%- endmacro %}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort or 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "<|end|>"
    "{%- set ns = namespace(last_final=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and not message['tool_calls']"
    " and text(message['content']) %}{% set ns.last_final = loop.index0 %}{% endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set role = message['role'] %}"
    "{%- if role in ('system', 'developer') %}"
    "{%- if not loop.first or text(message['content']) %}"
    "<|start|>developer<|message|># Instructions\n\n{{ text(message['content']) }}<|end|>"
    "{%- endif %}"
    "{%- elif role == 'assistant' %}"
    "{%- if message['tool_calls'] and text(message['content']) %}"
    "<|start|>assistant<|channel|>commentary<|message|>{{ text(message['content']) }}<|end|>"
    "{%- endif %}"
    "{%- if message['reasoning'] and loop.index0 > ns.last_final %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message['reasoning'] }}<|end|>"
    "{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "<|start|>assistant to=functions.{{ call['function']['name'] }}<|channel|>commentary json"
    "<|message|>{{ call['function']['arguments'] }}<|call|>"
    "{%- endfor %}"
    "{%- if not message['tool_calls'] and text(message['content']) %}"
    "<|start|>assistant<|channel|>final<|message|>{{ text(message['content']) }}<|end|>"
    "{%- endif %}"
    "{%- elif role == 'tool' %}"
    "{%- set call = namespace(name='') %}"
    "{%- for other in messages %}{% for c in other['tool_calls'] or [] %}"
    "{%- if c['id'] == message['tool_call_id'] %}{% set call.name = c['function']['name'] %}"
    "{%- endif %}{% endfor %}{% endfor %}"
    "<|start|>functions.{{ call.name }}<|channel|>commentary to=assistant<|message|>"
    "{{ text(message['content']) }}<|end|>"
    "{%- else %}<|start|>{{ role }}<|message|>{{ text(message['content']) }}<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def build_hybrid(arch: str, out_dir: Path | None = None, max_positions: int = 32768) -> Path:
    """Build (or reuse) the folder of one of ``HYBRID_SHAPES``' models and return its path:
    gpt-oss with gpt-oss's own tokenizer, the others with the Llama model's tokenizer and chat
    template (their own would need the hub, and the vocabulary only has to cover the text)."""
    if arch not in HYBRID_SHAPES:
        raise ValueError(f"unknown hybrid arch {arch!r}; choose from {', '.join(HYBRID_SHAPES)}")
    out_dir = out_dir or HYBRID_DIRS[arch]
    stamp = out_dir / "jiuwen-recipe.json"
    recipe = {
        "version": RECIPE_VERSION,
        "hybrid_version": HYBRID_RECIPE_VERSION,
        "arch": arch,
        "max_positions": max_positions,
        "shape": HYBRID_SHAPES[arch],
    }
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out_dir

    import torch
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if arch == "gpt-oss":
        tokenizer = _harmony_tokenizer(out_dir, max_positions)
    else:
        tokenizer = _bpe_tokenizer(out_dir, 4096, max_positions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hybrid_config(arch, tokenizer, max_positions))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps(recipe))
    return out_dir


def _hybrid_config(arch: str, tokenizer: Any, max_positions: int) -> Any:
    """The ``transformers`` config of a hybrid arch, its special ids the tokenizer's."""
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        MistralConfig,
        Qwen3NextConfig,
    )

    config_class = {
        "gpt-oss": GptOssConfig,
        "gemma3": Gemma3TextConfig,
        "mistral": MistralConfig,
        "qwen3-next": Qwen3NextConfig,
        "linear-only": Qwen3NextConfig,
        "deepseek-v3": DeepseekV3Config,
    }[arch]
    shape = {"vocab_size": len(tokenizer), **HYBRID_SHAPES[arch]}
    if arch == "gpt-oss":
        shape["rope_parameters"] = _gpt_oss_rope(max_positions)
    return config_class(
        **shape,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )


def _gpt_oss_rope(max_positions: int) -> dict[str, Any]:
    """gpt-oss's YaRN rope, its factor stretching 4k positions to ``max_positions`` rather than
    to 128k (``transformers`` warns of any other factor)."""
    original = 4096
    return {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": max_positions / original,
        "original_max_position_embeddings": original,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }


def _harmony_tokenizer(out_dir: Path, max_positions: int) -> Any:
    """gpt-oss's tokenizer (o200k_harmony), rebuilt offline, saved into ``out_dir``.

    vLLM renders gpt-oss chats itself with the harmony library (``openai_harmony``, from the
    ``oss-harmony`` package vLLM 0.32 installs: its vocabulary is compiled in, where OpenAI's
    ``openai-harmony`` downloads it on first use) and detokenizes the answers
    with this Hugging Face tokenizer, so this one must know every id the model can sample, and
    agree with harmony on text. The byte-pair ranks are read back from the harmony encoding; the
    merges are derived from them as ``transformers``' ``TikTokenConverter`` does: text encodes
    to the same ids as harmony's ``encode`` (a few seconds to build; 28 MB, like gpt-oss's own).
    """
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    ranks = _harmony_ranks(encoding)
    specials = [encoding.decode([i]) for i in range(len(ranks), HARMONY_VOCAB)]
    vocab, merges = _bpe_from_ranks(ranks)
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=max_positions,
    )
    fast.chat_template = GPT_OSS_CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _harmony_ranks(encoding: Any) -> dict[bytes, int]:
    """o200k's byte-pair tokens (bytes → id): the ids below the first special token. Read with
    the encoding's raw-bytes decoder (``_inner``: the public ``decode`` returns text and would
    mangle tokens that are partial UTF-8 sequences)."""
    ranks: dict[bytes, int] = {}
    while not encoding.is_special_token(len(ranks)):
        token = len(ranks)
        ranks[bytes(encoding._inner.decode_bytes([token]))] = token
    for token in range(len(ranks), HARMONY_VOCAB):
        if not encoding.is_special_token(token):
            raise RuntimeError(f"harmony token {token} is neither byte-pair nor special")
    return ranks


def _bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A tiktoken rank table as a byte-level BPE vocabulary and merge list: every split of a
    token into two tokens is a merge, ranked by the token's rank (ties by the parts' ranks)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    ranked: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked.append((rank, ranks[left], ranks[right], left, right))
    ranked.sort()  # a token's rank and its left part's rank say which split it is
    return vocab, [(text(left), text(right)) for *_, left, right in ranked]
