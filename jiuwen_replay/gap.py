"""Pure core: where one eviction policy's hits fall short of another's, call by call.

``benchmarks/lifecycle/belady_gap.py`` runs the simulator under the plugin's policy and under
Belady and hands both lists of hits per call (``simulator.hits_per_request``) to ``classify``:
every call Belady serves better is put in one class by what its session was doing, so the table
says what Belady keeps that the plugin lets go (issue 36: a lead waiting on its subagents, sibling
subagents' shared prompts, a tool loop's context, sessions back from their user, compaction
leftovers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_affinity.core import common_prefix_length

from .simulator import Request

#: The classes, in the order the report lists them.
CLASSES = (
    "first call of a lead",
    "first call of a subagent",
    "lead back from its subagents",
    "back after a rewrite",
    "back from its user (stop)",
    "tool loop, away 1 call",
    "tool loop, away 2-4 calls",
    "tool loop, away 5-10 calls",
    "tool loop, away more than 10 calls",
)


@dataclass(frozen=True)
class GapShare:
    """One class's share of the difference between two policies' hits."""

    calls: int  # calls of this class
    behind: int  # tokens Belady hits and the policy misses, on these calls
    ahead: int  # tokens the policy hits and Belady misses (Belady is optimal in total only)


def call_class(
    requests: Sequence[Request], index: int, previous: int | None, parents: Mapping[str, str]
) -> str:
    """What ``requests[index]``'s session was doing: its class in ``CLASSES``. ``previous`` is
    the index of the session's last call; ``parents`` maps a subagent to its lead."""
    request = requests[index]
    if previous is None:
        subagent = parents.get(request.session) not in (None, request.session)
        return CLASSES[1] if subagent else CLASSES[0]
    before = requests[previous]
    if any(parents.get(r.session) == request.session for r in requests[previous + 1 : index]):
        return CLASSES[2]
    if common_prefix_length(before.tokens, request.tokens) < len(before.tokens):
        return CLASSES[3]
    if before.finish == "stop":
        return CLASSES[4]
    away = index - previous
    if away == 1:
        return CLASSES[5]
    return CLASSES[6] if away <= 4 else CLASSES[7] if away <= 10 else CLASSES[8]


def classify(
    requests: Sequence[Request],
    parents: Mapping[str, str],
    policy_hits: Sequence[int],
    belady_hits: Sequence[int],
) -> dict[str, GapShare]:
    """Per class: its calls, and the tokens by which Belady's hits exceed (or fall short of)
    the policy's on them."""
    if not len(requests) == len(policy_hits) == len(belady_hits):
        raise ValueError("one hit count per request is needed from each policy")
    calls: Counter[str] = Counter()
    behind: Counter[str] = Counter()
    ahead: Counter[str] = Counter()
    last: dict[str, int] = {}
    for index, request in enumerate(requests):
        kind = call_class(requests, index, last.get(request.session), parents)
        calls[kind] += 1
        difference = belady_hits[index] - policy_hits[index]
        if difference > 0:
            behind[kind] += difference
        else:
            ahead[kind] -= difference
        last[request.session] = index
    return {k: GapShare(calls[k], behind[k], ahead[k]) for k in CLASSES}
