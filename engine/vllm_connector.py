"""kvblend as the KV cache of a vLLM engine: a KV connector (vLLM's ``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBlendConnector",
                           "kv_connector_module_path": "kvblend.engine.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"url": "http://127.0.0.1:8000",
                                                         "api_token_env": "KVBLEND_API_TOKEN",
                                                         "mode": "prefix"}}'

This module runs inside vLLM's processes, on top of ``dataplane.client.BlendClient``. It owns the
connector vLLM loads by name: its settings and its connection to kvblend. The claim (how many
prompt tokens kvblend provides) and the per-step plan handed from vLLM's scheduler to its workers
are the scheduler side's (``engine.vllm_scheduler``; the plan's types: ``engine.vllm_plan``), the
mapping of those tokens to vLLM's cache blocks the worker side's (``engine.vllm_worker``). None
of them owns the copies (the data plane moves whole chunks between the slab and vLLM's blocks,
turning K to new positions) nor any attention (vLLM computes every token it is not given).

vLLM asks a connector one question per new request: how many tokens from the start of the prompt
it provides. vLLM then computes the rest and never checks what the connector wrote, so whatever is
claimed must be complete: every position ``[0, claim)`` filled in every layer.

    mode     claim                                              what fills it
    prefix   the longest run of chunks from position 0 whose    those chunks, looked up by the
             keys equal the prompt's own prefix-chained keys    prompt's own keys: exactly the KV
                                                                a full prefill computes
    blend    up to the end of the last stored chunk before      each chunk wherever it was stored
             the question, through any gaps: templates,         (K turned to its new position),
             separators, partial chunks, an unstored system     then CacheBlend in the worker
             prompt (``shm.lookup``'s cover, wherever the       (``engine.vllm_blend``): the gaps
             chunks were computed)                              computed in every layer, the rows
                                                                ``ratio`` selects recomputed

Both claims stop one token short of the prompt (vLLM computes at least its last token). Blending
runs vLLM's own modules, which vLLM does not hand to connectors: kvblend's ``vllm.general_plugins``
entry point (``engine.vllm_plugin``, installed with kvblend) gives the worker its model. Without
it, or for a model the loop cannot run, every blended load is reported as a load error and vLLM
recomputes it (a warning says why at start).

Blend mode loads approximate KV. vLLM's prefix caching would index those blocks under the exact
hashes of their tokens (a connector's tokens are cached like computed ones, and no hook marks them
otherwise) and serve them to later prompts as exact: blend mode refuses to start with it on.

After a prefill completes, the worker stores the prompt's full chunks with ``store_final`` (the
copies run in the data plane while vLLM goes on; the request's blocks are held until they finished,
through ``request_finished`` and ``get_finished``; a preempted request's pending store is waited
for before vLLM reuses its blocks, ``handle_preemptions``). A blend-mode prompt is stored only when
every chunk it loaded was prefix-exact, so stored KV is always what a full prefill computes.

kvblend down when vLLM starts, or gone later: vLLM serves, computing everything; the connector
tries to connect again at most every ``retry_s`` seconds (default 10) and claims once it did.

Tensor parallelism: every rank's worker retrieves its own shard and runs the loop on the same
rows; a chunk counts as loaded only if every rank loaded it, and the deviation is summed over the
ranks before the selection, so every rank keeps the same rows and vLLM's collectives inside the
layers stay in step (``engine.vllm_blend``). Its counters reach vLLM's stats and metrics
(``engine.vllm_stats``).

Per step (one scheduler and one worker instance per engine; the plan is ``KVBlendMetadata``)::

    scheduler                                       worker
    get_num_new_matched_tokens: lookup, claim
    update_state_after_alloc: the request's blocks
    build_connector_meta: loads, saves, ------->    handle_preemptions: wait for their stores
        preempted requests                          start_load_kv: retrieve into the blocks,
                                                        layer-wise (layer i usable once copied);
                                                        blend: the layer loop, done before
                                                        vLLM's forward
                                                    wait_for_layer_load(i): wait for layer i
                                                    (vLLM's forward)
                                                    wait_for_save: store finished prefills
                                                    get_block_ids_with_load_errors: the blocks of
                                                        chunks not loaded (evicted meanwhile);
                                                        vLLM recomputes them ("recompute" policy)
    request_finished: hold blocks while storing <-- get_finished: stores done

vLLM's caches are registered with the data plane as they are, no staging copy: on CPU each layer
is ``[blocks, kv_heads, block_size, 2 * head_dim]`` (K of a block and head transposed, then V:
``dataplane.paged``'s ``cpu_kt``), and the memory vLLM allocated is moved into a kvblend shm
segment in place (``BlendClient.share_cpu_tensor``; a cache under 32 MiB, which may share pages
with other allocations, is not registered); on CUDA the FlashAttention (``[2, blocks,
block_size, kv_heads, head_dim]``) and FlashInfer layouts are shared by CUDA IPC.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvblend.dataplane.client import BlendClient, Namespace
from kvblend.dataplane.errors import DataPlaneError, DataPlaneUnavailable
from kvblend.engine.blend import DEFAULT, Mode, cacheblend
from kvblend.engine.vllm_plan import KVBlendMetadata
from kvblend.engine.vllm_scheduler import SchedulerSide
from kvblend.engine.vllm_stats import KVBlendPromMetrics, KVBlendStats
from kvblend.engine.vllm_worker import WAIT_S, WorkerSide

log = logging.getLogger("kvblend.vllm")

MODES = ("prefix", "blend")
RETRY_S = 10.0  # kvblend unreachable: the next connection attempt after this long


def _client(extra: dict[str, Any]) -> BlendClient:
    url = extra["url"]
    token_env = extra.get("api_token_env")
    token = os.environ.get(token_env) if token_env else None
    if token_env and not token:
        raise ValueError(f"api_token_env names {token_env!r}, which is not set")
    return BlendClient(str(url), token, timeout=float(extra.get("timeout_s", 30.0)))


def _blend_mode(extra: dict[str, Any]) -> Mode:
    """Blend mode's selection from ``kv_connector_extra_config`` (the reference engine's
    ``DEFAULT`` where not given); ``ratio`` 0 is naive reuse.

    Raises:
        ValueError: a value ``Mode`` refuses, or not a number.
    """
    ratio = float(extra.get("ratio", DEFAULT.ratio))
    if ratio == 0.0:
        return Mode("naive")
    return cacheblend(ratio, check_layer=int(extra.get("check_layer", DEFAULT.check_layer)),
                      widen=float(extra.get("widen", DEFAULT.widen)))


class KVBlendConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """vLLM's connector to a ``kvblend serve`` (module docstring).

    ``kv_connector_extra_config``: ``url`` (required), ``api_token_env`` (the variable holding
    the API token), ``mode`` (``prefix`` or ``blend``, default ``prefix``), ``model_name``
    (default: vLLM's served model name), ``timeout_s``, ``retry_s``; blend mode's selection,
    as the reference engine's (``engine.blend.cacheblend``): ``ratio`` (default 0.15),
    ``widen`` (default 2: gradual filtering), ``check_layer`` (default 1); ``ratio`` 0 is naive
    reuse (the gaps computed, no chunk row). A request's ``cache_salt`` is its kvblend namespace
    salt too.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.mode = str(extra.get("mode", "prefix"))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self.blend_mode = _blend_mode(extra)
        model = vllm_config.model_config
        self.model_name = str(extra.get("model_name") or model.served_model_name or model.model)
        self.world_size = int(vllm_config.parallel_config.tensor_parallel_size)
        Namespace(self.model_name, self.world_size)  # refuse a name kvblend refuses, now
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.mode == "blend" and vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("blend mode loads approximate KV, which vLLM's prefix caching would "
                             "index as exact: turn it off (--no-enable-prefix-caching)")
        if "url" not in extra or not extra["url"]:
            raise ValueError("kv_connector_extra_config needs the kvblend service's 'url'")
        self._extra = extra
        self._retry_s = float(extra.get("retry_s", RETRY_S))
        self._client: BlendClient | None = None
        self._next_try = 0.0
        self.chunk = 0
        self._init_scheduler_side()
        self._init_worker_side()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads are layer-wise (``wait_for_layer_load`` between vLLM's layers)."""
        return True

    @property
    def client(self) -> BlendClient:
        """The connection to kvblend.

        Raises:
            DataPlaneUnavailable: not connected, and not reconnected now (``retry_s``).
        """
        if self._client is None:
            now = time.monotonic()
            if now < self._next_try:
                raise DataPlaneUnavailable("kvblend is unreachable (retrying later)")
            self._next_try = now + self._retry_s
            try:
                self._client = _client(self._extra)
            except DataPlaneError as exc:
                log.warning("kvblend at %s is unreachable, vLLM computes every token; retrying "
                            "in %.0f s: %s", self._extra["url"], self._retry_s, exc)
                raise
            self.chunk = self._client.chunk_size
        return self._client

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendStats:
        return KVBlendStats() if data is None else KVBlendStats(data=dict(data))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVBlendPromMetrics:
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for t in self._saving.values():
            if t is not None:
                try:
                    t.wait(timeout=WAIT_S)
                except DataPlaneError:
                    pass
        if self._client is not None:
            self._client.close()


def shutdown_llm(llm: Any) -> None:
    """Shut an in-process ``vllm.LLM`` down (it has no method for it): its engine core stops,
    the worker's connector waits for its stores and unregisters from kvblend, and the engine's
    memory can be freed once the caller drops ``llm``."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


__all__ = ["KVBlendConnector", "KVBlendMetadata", "MODES", "shutdown_llm"]
