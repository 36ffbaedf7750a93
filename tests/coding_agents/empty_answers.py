"""A vLLM logits processor for the coding agents' tests: the test model answers empty (its first
token is end-of-sequence) when a test asks for it, as real models at times do.

The test writes a count into the file ``JIUWEN_EMPTY_ANSWERS_FILE`` names; the next that many
requests the engine starts answer nothing, and the count goes down as they start (the processor
runs in the engine's model-runner process: the file is the one channel both share).
``--logits-processors tests.coding_agents.empty_answers:EmptyAnswers`` loads it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FILE_ENV = "JIUWEN_EMPTY_ANSWERS_FILE"
FQCN = "tests.coding_agents.empty_answers:EmptyAnswers"


def ask_empty(path: Path, answers: int = 1) -> None:
    """The next ``answers`` requests the engine starts answer nothing."""
    path.write_text(str(answers))


def pending(path: Path) -> int:
    """Empty answers asked for and not given yet."""
    return int(path.read_text() or 0) if path.exists() else 0


class EmptyAnswers(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        flag = os.environ.get(FILE_ENV)
        self._file = Path(flag) if flag else None
        eos = vllm_config.model_config.hf_config.eos_token_id
        self._eos = eos[0] if isinstance(eos, list) else int(eos)
        self._forced: dict[int, list[int]] = {}  # batch index → its output tokens so far

    def is_argmax_invariant(self) -> bool:
        return False

    def _take(self) -> bool:
        if self._file is None or (left := pending(self._file)) <= 0:
            return False
        self._file.write_text(str(left - 1))
        return True

    def _new(self, params: Any, prompt: list[int] | None, output: list[int]) -> list[int] | None:
        return output if not output and self._take() else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._forced, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, output in self._forced.items():
            if not output:  # its first token: end of sequence, nothing else
                logits[index] = float("-inf")
                logits[index, self._eos] = 0.0
        return logits
