"""Pure core: the names the API server writes into a request's ``SamplingParams.extra_args`` and
the engine reads there, and the kinds of KV-cache group both sides tell apart (no vLLM import).

Both processes import these from here, so neither imports the other's modules."""

#: Key of a request's instruction length in tokens in ``SamplingParams.extra_args`` (set by the
#: API server on a hybrid model's requests).
CHECKPOINT_KEY = "kv_checkpoint"
#: Key of the in-request hint in ``SamplingParams.extra_args`` (set by the API-server wrap).
HINT_KEY = "kv_release"
#: Key of the request's parent session in ``SamplingParams.extra_args`` (subagents).
PARENT_KEY = "kv_parent"
#: Key of the request's principal in ``SamplingParams.extra_args`` (``core/tenants.py``).
PRINCIPAL_KEY = "kv_principal"
#: Key of a compaction the API server told from the agent's own requests
#: (``core/compaction.py``): the request's window rewrote its session's main thread.
REWRITE_KEY = "kv_rewrite"
#: Key of a retry the API server told (``core/compaction.py``): the request's window replaced
#: its main thread's last message; the replaced window is kept apart until the next one.
RETRY_KEY = "kv_retry"
#: Key of a subagent's instruction length in tokens (``api_server/instructions.py``): its end
#: keeps them.
HEAD_KEY = "kv_head"
#: Key of the request's ``X-KV-Next-Use`` (seconds), for the predicted-return picker.
NEXT_USE_KEY = "kv_next_use"
#: The keys above: set by the API server only, never taken from a client's ``vllm_xargs``.
RESERVED_KEYS = (
    HINT_KEY,
    PARENT_KEY,
    PRINCIPAL_KEY,
    REWRITE_KEY,
    RETRY_KEY,
    HEAD_KEY,
    NEXT_USE_KEY,
    CHECKPOINT_KEY,
)

#: Kinds of group that keep every block of a prompt: their hit needs no checkpoint.
DENSE_KINDS = frozenset({"full_attention", "mla_attention"})
