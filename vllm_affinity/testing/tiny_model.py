"""Build the small local model used by the tests, the demo and the benchmarks.

No model hub is reachable here, so the model is made from scratch: a Llama-architecture network
with random weights (hit rates and latencies do not depend on weight values; the text it writes
is gibberish), a byte-level BPE tokenizer trained locally with ``tokenizers``, and a Jinja chat
template that renders tools and tool calls. Built once into a cache folder, then reused.

    python -m vllm_affinity build-model [--out DIR] [--size tiny|heavy|long]  # prints the folder
    python -m vllm_affinity build-model --arch gpt-oss|gemma3|qwen3-next|deepseek-v3 [--out DIR]

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

``--arch`` builds hybrid models instead: ``hybrid_model.py`` (the command: ``build_model.py``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

#: Bump when the recipe changes, so cached builds are rebuilt.
RECIPE_VERSION = 2
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-llama"
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

#: ``--arch`` choices: Llama (``build``, every ``--size``), then the hybrids (``build_hybrid``).
ARCHS = ("llama", "gpt-oss", "gemma3", "mistral", "qwen3-next", "linear-only", "deepseek-v3")

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
