"""The worker's half of the vLLM connector: vLLM's caches registered, the plan carried out.

This module owns what ``KVBlendConnector`` does in each vLLM worker: registering vLLM's paged
caches with kvblend as they are (``dataplane.paged``'s layouts, no staging copy), retrieving each
planned load into the request's blocks layer by layer (or, in blend mode, running the layer loop
of ``engine.vllm_blend`` before vLLM's forward), storing finished prefills, holding a request's
blocks while its store runs, and reporting the blocks of chunks not loaded so that vLLM
recomputes them. The plan comes from the scheduler side (``engine.vllm_plan``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvblend.dataplane.client import BlendClient, Transfer
from kvblend.dataplane.errors import BadRequest, DataPlaneError, DataPlaneUnavailable
from kvblend.dataplane.messages import MAX_LAYER_GROUP_MATCHES
from kvblend.engine import vllm_blend, vllm_plugin
from kvblend.engine.blend import Mode, rotary_config
from kvblend.engine.vllm_plan import KVBlendMetadata, Load
from kvblend.engine.vllm_stats import KVBlendStats

log = logging.getLogger("kvblend.vllm")

WAIT_S = 120.0  # a layer or a whole load not copied by then fails the step
# A CPU cache is shared page by page (``BlendClient.share_cpu_tensor``): it must own its pages.
# glibc gives an allocation its own mapping above its mmap threshold, which is at most 32 MiB;
# below, it may sit on the heap beside other allocations, whose bytes would then be moved too.
MIN_CPU_CACHE_BYTES = 32 << 20


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


class WorkerSide:
    """The worker's methods of ``KVBlendConnector`` (vLLM builds one connector per process and
    role; each worker's calls these). Its state is set by ``_init_worker_side``; it reads the
    connector's settings and connection, declared below."""

    # the connector's (engine.vllm_connector, and vLLM's KVConnectorBase_V1)
    client: BlendClient
    mode: str
    blend_mode: Mode
    model_name: str
    world_size: int
    block_size: int
    _vllm_config: Any
    _get_connector_metadata: Callable[[], KVConnectorMetadata]

    def _init_worker_side(self) -> None:
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


__all__ = ["MIN_CPU_CACHE_BYTES", "WAIT_S", "WorkerSide"]
