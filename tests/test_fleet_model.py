"""The fleet model's invariants (``benchmarks/fleet_model.py``): what any run of it must satisfy,
checked on small seeded traces. CPU only, no processes."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fleet_model.py"
_spec = importlib.util.spec_from_file_location("fleet_model", _PATH)
assert _spec is not None and _spec.loader is not None
fm = importlib.util.module_from_spec(_spec)
sys.modules["fleet_model"] = fm  # dataclasses look their module up by name
_spec.loader.exec_module(fm)

SHAPE = fm.MODELS["8b"]
COSTS = fm.Costs()
#: small and quick: 500 documents, 200 requests a host
W = fm.Workload(docs=500, requests=200)


def run(hosts: int, w: fm.Workload = W, costs: fm.Costs = COSTS, tier: bool = True,
        seed: int = 0) -> fm.Result:
    return fm.simulate(fm.make_trace(hosts, w, seed), hosts, SHAPE, costs, w, tier=tier)


def unique_share(hosts: int, w: fm.Workload, seed: int = 0) -> float:
    trace = fm.make_trace(hosts, w, seed)
    draws = [d for _, _, docs in trace for d in docs]
    return len(set(draws)) / len(draws)


def test_one_host_has_no_remote_hits_even_when_it_refetches_its_own_writes() -> None:
    small = replace(W, store_bytes=8 * SHAPE.chunk_bytes * W.doc_chunks)  # 8 documents
    res = run(1, small)
    assert res.own > 0, "a store of 8 documents evicts, and the tier gives them back"
    assert res.remote - res.own == 0
    assert run(2, small).remote - run(2, small).own > 0, "two hosts do share"


@pytest.mark.parametrize("hosts", [1, 4])
def test_unbounded_stores_hit_all_but_the_first_sight_of_each_document(hosts: int) -> None:
    """With every document kept, and requests far apart (no two in flight at once), a document
    misses only the first time the fleet sees it: hit rate = 1 - unique / draws."""
    w = replace(W, store_bytes=math.inf, rate=0.01)
    res = run(hosts, w)
    hits = res.rate(res.local + res.remote)
    assert hits == pytest.approx(1 - unique_share(hosts, w), abs=0.01)
    if hosts > 1:
        alone = run(hosts, w, tier=False)
        assert alone.rate(alone.local) < hits - 0.05, "without the tier, each host misses alone"


def test_with_an_infinitely_fast_link_the_tier_never_loses_to_recompute() -> None:
    fast = replace(COSTS, link=math.inf, tier=math.inf, latency_s=0.0)
    res = run(8, costs=fast)
    assert res.remote > 0
    assert max(res.ttft) <= fm.recompute_ttft(W, fast) + 1e-12
    assert max(res.queue) == 0.0


@pytest.mark.parametrize("which", ["link", "tier"])
def test_queueing_grows_as_the_link_slows(which: str) -> None:
    """Each queue alone (the other infinitely fast): the hosts' fetch paths, then the tier."""
    busy = replace(W, rate=4.0)
    means = []
    for gbps in (8.0, 1.49, 0.5):
        res = run(8, busy, replace(COSTS, **{"link": math.inf, "tier": math.inf,
                                             which: gbps * fm.GB}))
        means.append(sum(res.queue) / len(res.queue))
    assert 0 < means[0] < means[1] < means[2], means


def test_a_seed_fixes_the_trace() -> None:
    assert fm.make_trace(4, W, 3) == fm.make_trace(4, W, 3)
    assert fm.make_trace(4, W, 3) != fm.make_trace(4, W, 4)
