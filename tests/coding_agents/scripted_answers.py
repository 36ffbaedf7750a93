"""A vLLM logits processor for the coding agents' tests: the test model answers what a test
scripts, as a real model would answer something else each time.

The test model (``tiny_model.py``'s ``long`` variant) answers "summary ok." to everything. A
test writes a script into the file ``JIUWEN_SCRIPTED_ANSWERS_FILE`` names (JSON); the requests
the engine starts next answer it, and the script is consumed as they start (the processor runs
in the engine's model-runner process: the file is the one channel both share):

- ``answers``: texts, one per request, in the order requests start (``""``: an empty answer,
  its first token end-of-sequence, as real models at times answer);
- ``unique``: once the scripted answers are given, every request answers "summary ok." and a
  reference of its own (a real model's answers differ; conversations told by their answers
  need that).

``--logits-processors tests.coding_agents.scripted_answers:ScriptedAnswers`` loads it."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FILE_ENV = "JIUWEN_SCRIPTED_ANSWERS_FILE"
FQCN = "tests.coding_agents.scripted_answers:ScriptedAnswers"


def script(path: Path, answers: list[str] | None = None, unique: bool | None = None) -> None:
    """The next requests answer ``answers`` (in order); ``unique``: then every request answers
    one of its own (unchanged when ``None``)."""
    current = read(path)
    current["answers"] = [*current.get("answers", []), *(answers or [])]
    if unique is not None:
        current["unique"] = unique
    path.write_text(json.dumps(current))


def ask_empty(path: Path, answers: int = 1) -> None:
    """The next ``answers`` requests the engine starts answer nothing."""
    script(path, [""] * answers)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text() or "{}") if path.exists() else {}


def pending(path: Path) -> int:
    """Scripted answers not given yet."""
    return len(read(path).get("answers", []))


class ScriptedAnswers(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        flag = os.environ.get(FILE_ENV)
        self._file = Path(flag) if flag else None
        self._tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        eos = vllm_config.model_config.hf_config.eos_token_id
        self._eos = eos[0] if isinstance(eos, list) else int(eos)
        #: batch index → (its forced tokens, its output tokens so far)
        self._forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def _take(self) -> str | None:
        if self._file is None:
            return None
        current = read(self._file)
        answers = current.get("answers", [])
        if answers:
            text = answers.pop(0)
            self._file.write_text(json.dumps(current))
            return str(text)
        if current.get("unique"):
            return f"summary ok. (ref {secrets.token_hex(4)})"
        return None

    def _new(
        self, params: Any, prompt: list[int] | None, output: list[int]
    ) -> tuple[list[int], list[int]] | None:
        if output:
            return None
        text = self._take()
        if text is None:
            return None
        tokens = self._tokenizer.encode(text, add_special_tokens=False) if text else []
        return [*tokens, self._eos], output

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._forced, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (tokens, output) in self._forced.items():
            step = min(len(output), len(tokens) - 1)
            logits[index] = float("-inf")
            logits[index, tokens[step]] = 0.0
        return logits
