"""Fault trials, bounded for CI (``tests/faults.py`` says what is driven and how each count is
made; ``benchmarks/faults.py`` is the full run of docs/faults.md).

A few SIGKILLs of the data plane and the API, each aimed at a store or lookup in flight, and of
the supervisor, each followed by a new ``kvblend serve`` on the same prefix and port: no
acknowledged chunk lost, no torn or unfindable chunk, every restart ready and the engine's client
storing again, no process or name left behind. Kill-to-ready is printed, never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import KINDS, FaultTrials

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SEED = 20261203
PLAN = {"dataplane": 5, "api": 2, "supervisor": 2}


def test_kills_lose_nothing_and_leave_nothing(shm_prefix: str, tmp_path: Path) -> None:
    report = FaultTrials(shm_prefix, tmp_path / "serve.log", SEED, out=print).run(PLAN)
    print(report.table())
    assert report.problems() == []
    # the trials ran as planned and checked what they were meant to
    assert [t.kind for t in report.trials] == [k for k in KINDS for _ in range(PLAN[k])]
    assert all(t.check.chunks > 0 for t in report.trials)
    assert report.final.chunks == report.acked_chunks > 0
    assert all(t.exit_s is not None for t in report.trials if t.kind == "supervisor")
    assert report.log_errors == []
