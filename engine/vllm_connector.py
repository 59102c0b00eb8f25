"""kvblend as the KV cache of a vLLM engine: a KV connector (vLLM's ``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBlendConnector",
                           "kv_connector_module_path": "kvblend.engine.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"url": "http://127.0.0.1:8000",
                                                         "api_token_env": "KVBLEND_API_TOKEN",
                                                         "mode": "prefix"}}'

This module runs inside vLLM's processes, on top of ``dataplane.client.BlendClient``. It owns the
claim (how many prompt tokens kvblend provides), the per-step plan handed from vLLM's scheduler to
its workers, and the mapping of those tokens to vLLM's cache blocks. It does not own the copies
(the data plane moves whole chunks between the slab and vLLM's blocks, turning K to new positions)
nor any attention (vLLM computes every token it is not given).

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
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from kvblend.dataplane.client import BlendClient, Match, Namespace, Transfer, chunk_hashes
from kvblend.dataplane.errors import BadRequest, DataPlaneError, DataPlaneUnavailable
from kvblend.dataplane.messages import MAX_LAYER_GROUP_MATCHES
from kvblend.engine import vllm_blend, vllm_plugin
from kvblend.engine.vllm_stats import KVBlendPromMetrics, KVBlendStats
from kvblend.engine.blend import DEFAULT, Mode, cacheblend, rotary_config

log = logging.getLogger("kvblend.vllm")

MODES = ("prefix", "blend")
WAIT_S = 120.0  # a layer or a whole load not copied by then fails the step
RETRY_S = 10.0  # kvblend unreachable: the next connection attempt after this long
# A CPU cache is shared page by page (``BlendClient.share_cpu_tensor``): it must own its pages.
# glibc gives an allocation its own mapping above its mmap threshold, which is at most 32 MiB;
# below, it may sit on the heap beside other allocations, whose bytes would then be moved too.
MIN_CPU_CACHE_BYTES = 32 << 20


@dataclass
class Load:
    """Copy ``matches`` of request ``req_id`` into its blocks; in blend mode (``ratio`` not None)
    then blend positions ``[local, claim)``: compute ``gaps`` (the spans no match covers) and
    recompute the share ``ratio`` of the chunk rows."""

    req_id: str
    token_ids: np.ndarray
    matches: list[Match]
    block_ids: list[int]
    cache_salt: str
    claim: int = 0
    local: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    ratio: float | None = None


@dataclass
class Save:
    """Store the full chunks of request ``req_id``'s prompt from its blocks."""

    req_id: str
    token_ids: np.ndarray
    block_ids: list[int]
    cache_salt: str


@dataclass
class KVBlendMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler's connector to the workers'."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class _Request:
    """What the scheduler's connector knows of a live request."""

    token_ids: np.ndarray
    cache_salt: str
    claim: int = 0
    matches: list[Match] = field(default_factory=list)
    exact: bool = True  # every chunk loaded was prefix-exact
    block_ids: list[int] = field(default_factory=list)
    local: int = 0  # tokens vLLM's own prefix cache had when it asked
    given: int = 0  # tokens claimed from kvblend, after vLLM's own
    load: tuple[int, int] | None = None  # positions to load in the next step (blocks allocated)
    save: bool = False  # a store of its prompt was planned


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


def _blend_claim(found: list[Match], keys: list[bytes], n: int, chunk: int
                 ) -> tuple[int, list[Match], bool]:
    """Blend mode's claim: up to the end of the last stored chunk that starts before the
    prompt's last token (at most ``n - 1``), through any gaps; whether every chunk is the
    prompt's own (its prefix-chained key at its own position: exactly what a full prefill
    computes)."""
    chosen = [m for m in found if m.cur_st < n - 1]
    if not chosen:
        return 0, [], True
    exact = all(m.cur_st % chunk == 0 and m.old_st == m.cur_st and m.cur_st // chunk < len(keys)
                and bytes(m.chunk_hash) == keys[m.cur_st // chunk] for m in chosen)
    return min(chosen[-1].cur_ed, n - 1), chosen, exact


def _layout_of(first: torch.Tensor) -> tuple[str, int, tuple[int, int]]:
    """(layout name, block size, (kv heads, head dim)) of a layer of vLLM's paged cache.

    Raises:
        NotImplementedError: a layout kvblend does not copy.
    """
    if first.is_cuda:
        if first.dim() == 5 and first.shape[0] == 2:
            _, _, S, H, D = first.shape
            return "flash_attn", int(S), (int(H), int(D))
        if first.dim() == 5 and first.shape[1] == 2:
            _, _, S, H, D = first.shape
            return "flashinfer", int(S), (int(H), int(D))
        raise NotImplementedError(f"vLLM's CUDA KV cache of shape {tuple(first.shape)} is not a "
                                  "layout kvblend copies")
    if first.dim() != 4:
        raise NotImplementedError(f"vLLM's CPU KV cache of shape {tuple(first.shape)} is not a "
                                  "layout kvblend copies")
    if first.dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        raise NotImplementedError("vLLM packs a bfloat16 CPU cache for AMX, a layout kvblend "
                                  "does not copy: use float16 or float32")
    _, H, S, D2 = first.shape
    return "cpu_kt", int(S), (int(H), int(D2) // 2)


def _layer_index(name: str, fallback: int) -> int:
    found = re.search(r"\.(\d+)\.", name)
    return int(found.group(1)) if found else fallback


class KVBlendConnector(KVConnectorBase_V1):
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
        # scheduler side
        self._reqs: dict[str, _Request] = {}
        # worker side
        self._inst: int | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._layers: dict[str, int] = {}
        self._model: Any = None  # the worker's model (engine.vllm_plugin), to blend with
        self._paged: list[vllm_blend.PagedLayer] = []
        self._loading: list[tuple[Load, Transfer, bool]] = []  # (load, retrieve, layer-wise)
        self._load_errors: set[int] = set()
        self._saving: dict[str, Transfer | None] = {}
        self._finished: set[str] = set()
        self._stats = KVBlendStats()

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

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens after vLLM's own ``num_computed_tokens`` that kvblend provides (synchronous
        loads; one lookup through the API per request, about a millisecond on one host)."""
        req = self._reqs.get(request.request_id)
        if req is None:
            tokens = np.asarray(request.prompt_token_ids, dtype=np.int64)
            req = _Request(tokens, getattr(request, "cache_salt", None) or "")
            try:
                req.claim, req.matches, req.exact = self._claim(req)
            except (DataPlaneError, ValueError) as exc:  # kvblend down, a salt it refuses
                log.warning("kvblend lookup failed, computing request %s: %s",
                            request.request_id, exc)
            self._reqs[request.request_id] = req
        req.local = num_computed_tokens
        if self.mode == "blend":  # from position 0 only (vLLM's prefix caching is off)
            return (req.claim, False) if num_computed_tokens == 0 else (0, False)
        # the blocks vLLM's own cache filled stay untouched: load whole chunks after them only
        usable = [m for m in req.matches if m.cur_st >= num_computed_tokens]
        if not usable or usable[0].cur_st != num_computed_tokens:
            return 0, False
        return max(0, req.claim - num_computed_tokens), False

    def _claim(self, req: _Request) -> tuple[int, list[Match], bool]:
        """(claim, the chunks that fill it, whether all are prefix-exact) for a prompt."""
        tokens = req.token_ids
        found = self.client.lookup(tokens, self.model_name, self.world_size, req.cache_salt).matches
        C = self.chunk
        keys = chunk_hashes(Namespace(self.model_name, self.world_size, req.cache_salt), tokens, C)
        if self.mode == "blend":
            return _blend_claim(found, keys, len(tokens), C)
        at = {m.cur_st: m for m in found}
        chosen: list[Match] = []
        for i, key in enumerate(keys):  # the prompt's own keys: retrieve verifies them
            if i * C not in at:
                break
            chosen.append(Match(i * C, (i + 1) * C, i * C, (i + 1) * C, key, at[i * C].origin))
        claim = min(len(chosen) * C, len(tokens) - 1)
        return (claim, chosen, True) if claim > 0 else (0, [], True)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        req = self._reqs.get(request.request_id)
        if req is None:
            return
        req.given = num_external_tokens
        if num_external_tokens == 0:  # nothing claimed now (a resumed request may have been)
            req.load = None
            return
        req.block_ids = list(blocks.get_block_ids()[0])
        req.load = (req.local, req.local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBlendMetadata:
        meta = KVBlendMetadata(preempted=set(scheduler_output.preempted_req_ids or ()))
        done_after = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is None:
                continue
            req.block_ids = list(new.block_ids[0])
            self._plan_load(meta, new.req_id, req)
            self._plan_save(meta, new.req_id, req, new.num_computed_tokens
                            + done_after.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                if req_id in cached.resumed_req_ids:
                    req.block_ids = list(added[0])
                else:
                    req.block_ids.extend(added[0])
            if req_id in cached.resumed_req_ids:  # preempted, then claimed again
                self._plan_load(meta, req_id, req)
            self._plan_save(meta, req_id, req, cached.num_computed_tokens[i]
                            + done_after.get(req_id, 0))
        return meta

    def _plan_load(self, meta: KVBlendMetadata, req_id: str, req: _Request) -> None:
        """Load the claim in the request's first step after vLLM allocated its blocks."""
        if req.load is None:
            return
        start, end = req.load
        req.load = None
        matches = [m for m in req.matches if start <= m.cur_st < end]
        if not matches:
            return
        load = Load(req_id, req.token_ids, matches, req.block_ids, req.cache_salt, end, start)
        if self.mode == "blend":
            load.gaps = vllm_blend.gaps(matches, start, end)
            load.ratio = self.blend_mode.ratio
        meta.loads.append(load)

    def _plan_save(self, meta: KVBlendMetadata, req_id: str, req: _Request, computed: int) -> None:
        """Store the prompt in the step that completes its prefill."""
        if self.chunk == 0:  # never connected
            return
        n = len(req.token_ids) // self.chunk * self.chunk
        if req.save or computed < len(req.token_ids) or n == 0 or not req.exact:
            return
        req.save = True
        meta.saves.append(Save(req_id, req.token_ids[:n], req.block_ids[:-(-n // self.block_size)],
                               req.cache_salt))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks while the prompt's store runs; report what kvblend provided."""
        req = self._reqs.pop(request.request_id, None)
        if req is None:
            return False, None
        return req.save, {"kvblend": {"mode": self.mode, "loaded_tokens": req.given,
                                      "stored": req.save}}

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=lambda n: _layer_index(n, list(kv_caches).index(n)))
        self._layers = {name: i for i, name in enumerate(names)}
        self._caches = {n: kv_caches[n] for n in names}
        self._layout, S, self._geometry = _layout_of(kv_caches[names[0]])
        if S != self.block_size:
            raise NotImplementedError(f"cache blocks of {S} tokens, but vLLM's block size is "
                                      f"{self.block_size}")
        if self.mode == "blend":
            self._take_model()
        try:
            self._register()
        except DataPlaneUnavailable:
            pass  # warned; vLLM computes until kvblend answers
        except DataPlaneError as exc:
            log.warning("vLLM's KV cache is not registered with kvblend, vLLM computes every "
                        "token: %s", exc)

    def _register(self) -> int:
        """The instance of vLLM's caches in kvblend, registered on first need.

        Raises:
            DataPlaneError: kvblend unreachable, or refused the registration.
        """
        if self._inst is None:
            client = self.client
            layers = list(self._caches.values())
            if not layers[0].is_cuda:
                size = layers[0].untyped_storage().nbytes()
                if size < MIN_CPU_CACHE_BYTES:
                    raise BadRequest(f"vLLM's CPU KV cache of {size} bytes may share its memory "
                                     f"pages with other allocations; kvblend shares caches of "
                                     f"{MIN_CPU_CACHE_BYTES} bytes or more (raise "
                                     "kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE)")
                client.share_cpu_tensor(layers[0])  # every layer: one allocation
            rank = 0
            if self.world_size > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                rank = get_tensor_model_parallel_rank()
            H, D = self._geometry
            hf = self._vllm_config.model_config.hf_text_config
            self._inst = client.register_paged_kv_cache(
                layers, self._layout, self.block_size, H, D, model_name=self.model_name,
                world_size=self.world_size, worker_id=rank, rotary=rotary_config(hf))
        return self._inst

    def _take_model(self) -> None:
        """The worker's model, to blend with (``engine.vllm_plugin``), and its layers' caches."""
        model = vllm_plugin.model_for(self._vllm_config.model_config)
        why = None
        if model is None:
            why = ("the worker's model was not handed over: kvblend's vllm.general_plugins "
                   "entry point did not run (is kvblend installed where vLLM runs, and VLLM_PLUGINS "
                   "unset or naming kvblend?)")
        else:
            try:
                vllm_blend.check_model(model)
                self._paged = [vllm_blend.PagedLayer(
                    self._caches[layer.self_attn.attn.layer_name], self._layout, self.block_size,
                    *self._geometry) for layer in model.model.layers]
            except (ValueError, KeyError) as exc:
                why = f"this model is not blended: {exc!r}"
        if why is not None:
            log.warning("blend mode: %s; vLLM recomputes every blended load", why)
            return
        self._model = model

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's blocks are freed and reused: its prompt's store, still reading
        them, completes first."""
        assert isinstance(kv_connector_metadata, KVBlendMetadata)
        for req_id in kv_connector_metadata.preempted & set(self._saving):
            t = self._saving[req_id]
            if t is not None:
                try:
                    t.wait(timeout=WAIT_S)
                except DataPlaneError as exc:
                    log.warning("kvblend store of preempted request %s failed: %s", req_id, exc)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBlendMetadata)
        for load in meta.loads:
            if load.ratio is not None:
                self._blend(load)
                continue
            layerwise = len(load.matches) <= MAX_LAYER_GROUP_MATCHES
            try:
                t = self.client.retrieve(
                    self._register(), load.token_ids, load.matches, block_table=load.block_ids,
                    cache_salt=load.cache_salt, layer_groups=len(self._layers) if layerwise else 0)
            except DataPlaneError as exc:
                log.warning("kvblend retrieve of request %s failed: %s", load.req_id, exc)
                self._load_errors.update(self._blocks_of(load, range(len(load.matches))))
                continue
            self._stats.add(loads=1, loaded_tokens=load.claim - load.local)
            self._loading.append((load, t, layerwise))

    def _blend(self, load: Load) -> vllm_blend.Blended | None:
        """Retrieve a blend-mode load and run the layer loop on it (``engine.vllm_blend``), done
        before vLLM's forward; whatever fails is reported as load errors (vLLM recomputes).
        What the loop did, or None where it failed."""
        S = self.block_size
        everything = {load.block_ids[b] for b in range(load.local // S, (load.claim - 1) // S + 1)}
        if self._model is None:
            self._load_errors |= everything
            return None
        layerwise = len(load.matches) <= MAX_LAYER_GROUP_MATCHES
        t: Transfer | None = None
        try:
            t = self.client.retrieve(
                self._register(), load.token_ids, load.matches, block_table=load.block_ids,
                cache_salt=load.cache_salt, layer_groups=len(self._layers) if layerwise else 0)

            def wait_layer(i: int) -> list[int]:
                assert t is not None
                if layerwise:
                    return t.wait_layer(i, timeout=WAIT_S)
                return t.wait(timeout=WAIT_S).failed if i == 0 else []

            reduce = None
            if self.world_size > 1:
                from vllm.distributed import tensor_model_parallel_all_reduce as reduce
            with torch.inference_mode():
                done = vllm_blend.blend(
                    self._model, self._paged, S,
                    vllm_blend.BlendLoad(load.token_ids, load.claim, load.local, load.matches,
                                         load.block_ids), self.blend_mode, wait_layer, reduce)
            done.late |= set(t.wait(timeout=WAIT_S).failed) - done.first
        except Exception as exc:  # noqa: BLE001 - anything: vLLM recomputes, never wrong KV kept
            log.warning("kvblend blend of request %s failed, recomputed: %r", load.req_id, exc)
            if t is not None:
                try:
                    t.wait(timeout=WAIT_S)  # no copy may still be writing into the blocks
                except DataPlaneError:
                    pass
            self._load_errors |= everything
            return None
        self._stats.add(loads=1, loaded_tokens=load.claim - load.local,
                        gap_tokens=sum(e - s for s, e in load.gaps), recomputed_rows=done.computed,
                        blend_layers=len(self._paged))
        if done.late:
            log.info("request %s: %d of %d chunks not loaded, recomputed", load.req_id,
                     len(done.late), len(load.matches))
            self._load_errors.update(self._blocks_of(load, sorted(done.late)))
        return done

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading:
            return
        i = self._layers.get(layer_name, 0)
        for entry in list(self._loading):
            load, t, layerwise = entry
            try:
                if layerwise:
                    t.wait_layer(i, timeout=WAIT_S)
                elif i == 0:
                    t.wait(timeout=WAIT_S)
            except DataPlaneError as exc:  # the data plane gone or stuck: vLLM recomputes
                log.warning("kvblend load of request %s failed: %s", load.req_id, exc)
                self._load_errors.update(self._blocks_of(load, range(len(load.matches))))
                self._loading.remove(entry)
        if i == len(self._layers) - 1:
            self._end_loads()

    def _end_loads(self) -> None:
        for load, t, _ in self._loading:
            try:
                failed = t.wait(timeout=WAIT_S).failed
            except DataPlaneError as exc:
                log.warning("kvblend load of request %s failed: %s", load.req_id, exc)
                failed = list(range(len(load.matches)))
            if failed:
                log.info("request %s: %d of %d chunks not loaded, recomputed", load.req_id,
                         len(failed), len(load.matches))
                self._load_errors.update(self._blocks_of(load, failed))
        self._loading = []

    def _blocks_of(self, load: Load, failed: Any) -> set[int]:
        S = self.block_size
        out: set[int] = set()
        for j in failed:
            m = load.matches[j]
            out.update(load.block_ids[b] for b in range(m.cur_st // S, (m.cur_ed - 1) // S + 1))
        return out

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # whole prompts are stored after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self._loading:  # a forward that ran no attention layer
            self._end_loads()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBlendMetadata)
        for save in meta.saves:
            try:
                self._saving[save.req_id] = self.client.store_final(
                    self._register(), save.token_ids, block_table=save.block_ids,
                    cache_salt=save.cache_salt)
                self._stats.add(stores=1)
            except DataPlaneError as exc:
                log.warning("kvblend store of request %s failed: %s", save.req_id, exc)
                self._saving[save.req_id] = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Requests finished by vLLM whose prompt store has completed (their blocks are freed)."""
        self._finished.update(finished_req_ids)
        done = set()
        for req_id in self._finished & set(self._saving):
            t = self._saving[req_id]
            if t is None or t.done():
                try:
                    result = t.wait(timeout=WAIT_S) if t is not None else None
                except DataPlaneError as exc:
                    log.warning("kvblend store of request %s failed: %s", req_id, exc)
                    result = None
                if result is not None and not result.ok:
                    log.info("request %s: %d chunks not stored", req_id, len(result.failed))
                done.add(req_id)
        for req_id in done:
            del self._saving[req_id]
        self._finished -= done
        self._finished &= set(self._saving)  # finished requests that stored nothing
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        self._stats.add(load_errors=len(errors))
        return errors

    def get_kv_connector_stats(self) -> KVBlendStats | None:
        """The counters since vLLM last asked (``engine.vllm_stats``)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVBlendStats()
        return stats

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
