"""The churn soak, bounded for CI (tests/churn.py says what it drives and what it checks).

One ``kvblend serve`` with 8 MiB of storage and a fingerprint index of 128 entries; distinct
documents stored until they add up to 25x the index's capacity in chunks and 25x the storage in
bytes, with re-stores, clears, new models (past the store's 32 layout classes), data-plane
SIGKILLs (between calls and with a store in flight) and service restarts on the way, and a
checkpoint after each disturbance and every few dozen documents. Everything is drawn from one
seed: every run stores the same documents and meets the same events in the same order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.churn import Churn, Schedule, Sizes

pytestmark = pytest.mark.slow

SEED = 20261204
SIZES = Sizes()
SCHEDULE = Schedule()
FOLD = 25  # past the 10x the soak asks for: about 2 minutes on 2 cores


def test_churn_soak_keeps_every_invariant(shm_prefix: str, tmp_path: Path) -> None:
    with Churn(shm_prefix, tmp_path / "serve.log", SEED, SIZES, SCHEDULE) as churn:
        while not churn.targets_met(FOLD):
            churn.step()
        churn.checkpoint()
    c = churn.counts
    assert c.chunks >= FOLD * SIZES.fingerprint_capacity
    assert c.kv_bytes >= FOLD * (SIZES.storage_mb << 20)
    # the run met every disturbance, and the paths the checkpoint is about were taken
    assert c.clears >= 5 and c.restarts >= 8 and c.kills >= 25 and c.kills_in_flight >= 12
    assert c.models > 64 and c.restores > 250 and c.checkpoints > 150
    assert c.evictions > 5000 and c.not_indexed > 0 and c.most_held > SIZES.fingerprint_capacity
    assert churn.service is not None and churn.service.errors() == []
