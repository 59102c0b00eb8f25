"""The scheduler's half of the vLLM connector: the claim and the plan.

This module owns what ``KVBlendConnector`` does in vLLM's scheduler process: the claim (how many
prompt tokens kvblend provides, from one lookup per request, ``engine.vllm_connector``'s table of
modes), what it knows of each live request, and the plan of each step (``engine.vllm_plan``):
loads once vLLM allocated a request's blocks, a store once its prefill completed, the requests
preempted. It copies nothing; the worker side (``engine.vllm_worker``) carries the plan out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblend.dataplane.client import BlendClient, Match, Namespace, chunk_hashes
from kvblend.dataplane.errors import DataPlaneError
from kvblend.engine import vllm_blend
from kvblend.engine.blend import Mode
from kvblend.engine.vllm_plan import KVBlendMetadata, Load, Save

log = logging.getLogger("kvblend.vllm")


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


class SchedulerSide:
    """The scheduler's methods of ``KVBlendConnector`` (vLLM builds one connector per process
    and role; the scheduler's calls these). Its state is ``_reqs``; it reads the connector's
    settings and connection, declared below."""

    # the connector's (engine.vllm_connector)
    client: BlendClient
    mode: str
    blend_mode: Mode
    model_name: str
    world_size: int
    block_size: int
    chunk: int

    def _init_scheduler_side(self) -> None:
        self._reqs: dict[str, _Request] = {}

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


__all__ = ["SchedulerSide"]
