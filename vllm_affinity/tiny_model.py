"""Build the small local model used by the tests, the demo and the benchmarks.

No model hub is reachable here, so the model is made from scratch: a Llama-architecture network
with random weights (hit rates and latencies do not depend on weight values; the text it writes
is gibberish), a byte-level BPE tokenizer trained locally with ``tokenizers``, and a Jinja chat
template that renders tools and tool calls. Built once into a cache folder, then reused.

    python -m vllm_affinity.tiny_model [--out DIR] [--size tiny|heavy|long]  # prints the folder
    python -m vllm_affinity.tiny_model --arch gpt-oss|gemma3|qwen3-next [--out DIR]

``tiny`` (the default: ~3M parameters) keeps tests fast; ``heavy`` (~30M parameters, same
tokenizer and template) makes prefill cost what it costs on real hardware relative to the rest of
a request (a 2k-token prefill takes a few hundred ms on one core here), for benchmarks.

``long`` is ``tiny`` for the coding agents (Claude Code's first prompt alone is ~35k tokens of
this tokenizer): 128k positions, and answers that end after a few visible tokens, whatever the
prompt and the sampling. Its weights are random but for a few dimensions set by hand: every
token's embedding points the last position at a short chain of answer tokens that ends with
``</s>``, by a margin no sampling temperature an agent uses can overcome. A coding agent
treats an empty answer as a failure to retry, and an answer cut at ``max_tokens`` as an error;
this one is neither.

``--arch`` builds hybrid models instead, for vLLM's hybrid KV cache (one KV-cache group per kind
of layer, all in one block pool), each as small as ``tiny`` and with random weights too:
``gpt-oss`` (sliding-window and full attention alternating, experts; gpt-oss's own tokenizer,
rebuilt offline from the harmony library vLLM renders its chats with), ``gemma3`` (three
sliding-window layers to one full) and ``qwen3-next`` (Gated DeltaNet linear attention and full
attention alternating, experts), the last two with the Llama model's tokenizer and template.
Their folders: ``.cache/tiny-gpt-oss``, ``.cache/tiny-gemma3``, ``.cache/tiny-qwen3-next``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

#: Bump when the recipe changes, so cached builds are rebuilt.
RECIPE_VERSION = 2
#: Bump when the hybrid models' recipe changes beyond ``HYBRID_SHAPES`` (tokenizers, templates).
HYBRID_RECIPE_VERSION = 1
DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "tiny-llama"
HEAVY_DIR = DEFAULT_DIR.with_name("heavy-llama")

#: Network shapes by size: hidden, intermediate, layers, attention heads, KV heads.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (256, 512, 2, 4, 2),
    "heavy": (512, 1536, 8, 8, 4),
    "long": (256, 512, 2, 4, 2),
}
LONG_DIR = DEFAULT_DIR.with_name("long-llama")
#: Positions of the ``long`` variant.
LONG_POSITIONS = 131072
#: The ``long`` variant's answer: these words (one token each), then ``</s>``.
ANSWER_WORDS = ("summary", " ok", ".")

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
}
#: ``--arch`` choices: Llama (``build``, every ``--size``), then the hybrids (``build_hybrid``).
ARCHS = ("llama", *HYBRID_SHAPES)
HYBRID_DIRS = {arch: DEFAULT_DIR.with_name(f"tiny-{arch}") for arch in HYBRID_SHAPES}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>Available tools:\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</s>{% endif %}"
    "{%- for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{% for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{%- if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</call>"
    "{%- endfor %}{% endif %}"
    "{%- if message['tool_call_id'] %} [{{ message['tool_call_id'] }}]{% endif %}</s>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


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


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Text shaped like agent traffic: chat, JSON tool results, numbers, code-ish words."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "weather",
        "city",
        "temperature",
        "wind",
        "rain",
        "sunny",
        "cloud",
        "forecast",
        "hourly",
        "paris",
        "oslo",
        "lima",
        "tool",
        "result",
        "call",
        "function",
        "arguments",
        "user",
        "assistant",
        "system",
        "summary",
        "memory",
        "agent",
        "file",
        "read",
        "write",
        "search",
        "error",
        "ok",
        "true",
        "false",
        "null",
        "json",
        "value",
        "key",
        "list",
        "item",
        "step",
        "plan",
        "next",
    ]
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.4:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 25))))
        elif kind < 0.7:
            doc = {rng.choice(words): rng.randint(0, 9999) for _ in range(4)}
            out.append(json.dumps(doc))
        else:
            out.append(
                f"{rng.randint(0, 23):02d}:00 {rng.choice(words)} {rng.uniform(-20, 40):.1f}C"
            )
    return out


def build(
    out_dir: Path | None = None,
    vocab_size: int = 4096,
    max_positions: int = 32768,
    size: str = "tiny",
) -> Path:
    """Build (or reuse) the model folder and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(SIZES)}")
    out_dir = out_dir or {"tiny": DEFAULT_DIR, "heavy": HEAVY_DIR, "long": LONG_DIR}[size]
    if size == "long":
        max_positions = LONG_POSITIONS
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    stamp = out_dir / "jiuwen-recipe.json"
    recipe: dict[str, object] = {
        "version": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
    }
    if size != "tiny":  # the tiny recipe's stamp stays as it was: no rebuild for existing caches
        recipe["size"] = size
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out_dir

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    fast = _bpe_tokenizer(out_dir, vocab_size, max_positions)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=fast.backend_tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=size != "long",
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    if size == "long":
        _short_answers(model, [fast.convert_tokens_to_ids(t) for t in _answer_tokens(fast)])
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps(recipe))
    return out_dir


def _bpe_tokenizer(out_dir: Path, vocab_size: int, max_positions: int) -> Any:
    """Train the byte-level BPE tokenizer on the agent-shaped corpus and save it, with the chat
    template, into ``out_dir``; return it (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _answer_tokens(tokenizer: Any) -> list[str]:
    """The answer words as single tokens, then the end-of-sequence token."""
    tokens = []
    for word in ANSWER_WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"answer word {word!r} is {len(ids)} tokens, not one")
        tokens.append(tokenizer.convert_ids_to_tokens(ids[0]))
    return [*tokens, tokenizer.eos_token]


def _short_answers(model: Any, chain: list[int]) -> None:
    """Hand-set dimensions 0..len(chain)-1 of the embeddings and the output head: any token
    outside the chain selects ``chain[0]``, ``chain[i]`` selects ``chain[i + 1]``. The residual
    stream at the last position is dominated by the last token's embedding (the random layers
    add little), so the model is, in effect, this bigram chain."""
    import torch

    stages = len(chain)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        embed[:, :stages] = 0.0
        head[:, :stages] = 0.0
        embed[:, 0] = 4.0  # stage 0: any token
        for stage, token in enumerate(chain[:-1], start=1):
            embed[token, 0] = 0.0
            embed[token, stage] = 4.0
        for stage, token in enumerate(chain):
            head[token, stage] = 3.0


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
    from transformers import Gemma3TextConfig, GptOssConfig, Qwen3NextConfig

    config_class = {
        "gpt-oss": GptOssConfig,
        "gemma3": Gemma3TextConfig,
        "qwen3-next": Qwen3NextConfig,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a small local test model.")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="llama only")
    args = parser.parse_args(argv)
    if args.arch != "llama":
        if args.size is not None:
            parser.error("--size applies to --arch llama only")
        print(build_hybrid(args.arch, args.out))
        return 0
    print(build(args.out, size=args.size or "tiny"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
