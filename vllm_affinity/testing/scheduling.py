"""vLLM's scheduler-side classes without a model, driven as the engine core drives them (for the
adapter tests and ``benchmarks/engine/engine_scale.py``).

- ``scheduler``: vLLM's real ``Scheduler`` over a KV-cache config, its model config read from a
  config file written here (no weights, no tokenizer), so it runs at any pool size on a CPU.
- ``step``: one engine step without a model: ``schedule``, every request that finished its
  prefill samples a token, ``update_from_output``.
- ``bind_as_scheduled``: for a driver of the ``KVCacheManager`` alone (no scheduler), the step
  output the scheduler would build for an allocation, handed to the plugin's step binding
  (``bind_step``) as the ``Scheduler.schedule`` wrapper hands it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ..engine import affinity_of, bind_step


@cache
def _model_dir(max_model_len: int) -> str:
    """A Llama config (no weights) that allows ``max_model_len`` positions."""
    from transformers import LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="vllm-affinity-scheduler-"))
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, vocab_size=1024, max_position_embeddings=max_model_len,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def scheduler(
    kv_cache_config: Any,
    max_model_len: int = 4096,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    prefix_caching: bool = True,
    kv_transfer_config: Any = None,
) -> Any:
    """vLLM's ``Scheduler`` over ``kv_cache_config`` (chunked prefill; prefix caching on
    unless told; ``kv_transfer_config``: a KV connector's scheduler side, e.g. an offloader)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=_model_dir(max_model_len), skip_tokenizer_init=True,
        max_model_len=max_model_len, dtype="float32",
    )  # fmt: skip
    scheduling = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
    )  # fmt: skip
    caching = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    caching.num_gpu_blocks = kv_cache_config.num_blocks
    config = VllmConfig(
        model_config=model, scheduler_config=scheduling, cache_config=caching,
        device_config=DeviceConfig(device="cpu"),  # no model runs: no device to detect
        kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    return Scheduler(
        vllm_config=config, kv_cache_config=kv_cache_config, log_stats=False,
        structured_output_manager=StructuredOutputManager(config), block_size=block_size,
    )  # fmt: skip


def step(
    scheduler: Any, token: int = 7, connector: Callable[[Any], Any] | None = None
) -> list[str]:
    """One engine step with no model: every scheduled request whose prompt is computed samples
    ``token``; ``connector``: what the workers' KV connector reports of the step (its
    ``KVConnectorOutput``, from the step's output), as if its transfers were done. The ids of
    the requests that finished in it."""
    from vllm.v1.outputs import ModelRunnerOutput

    output = scheduler.schedule()
    requests = scheduler.requests
    ids = list(output.num_scheduled_tokens)
    sampled = [
        [token] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in ids
    ]
    runner = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    if connector is not None:
        runner.kv_connector_output = connector(output)
    finished: list[str] = []
    for outputs in scheduler.update_from_output(output, runner).values():
        finished += [o.request_id for o in outputs.outputs if o.finish_reason is not None]
    return finished


def bind_as_scheduled(manager: Any, request: Any, new_blocks: Any, first: bool) -> None:
    """What the scheduler's step output says of an allocation (``new_blocks``,
    ``allocate_slots``' answer), bound as the plugin binds a step: a new request's whole block
    lists (``first``), else a running request's new blocks."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    state = affinity_of(manager.block_pool)
    if state is None:
        return
    rid = request.request_id
    output = SchedulerOutput.make_empty()
    if first:
        ids = manager.get_block_ids(rid)
        output.scheduled_new_reqs.append(NewRequestData.from_request(request, ids))
    else:
        output.scheduled_cached_reqs.req_ids.append(rid)
        output.scheduled_cached_reqs.new_block_ids.append(new_blocks.get_block_ids(allow_none=True))
    bind_step(state, {rid: request}, output)
