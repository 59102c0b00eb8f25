"""One step's plan, from the scheduler's connector to the workers': what to load into which
blocks, what to store, which requests were preempted.

This module owns the plan's types only; the scheduler side (``engine.vllm_scheduler``) builds it
in ``build_connector_meta``, vLLM hands it to every worker, and the worker side
(``engine.vllm_worker``) carries it out. vLLM sends it between processes, so it holds plain data:
token ids, matches, block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvblend.dataplane.client import Match


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


__all__ = ["KVBlendMetadata", "Load", "Save"]
