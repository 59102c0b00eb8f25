"""The churn soak, bounded for CI (tests/churn.py says what it drives and what it checks).

One ``kvblend serve`` with 8 MiB of storage and a fingerprint index of 128 entries; distinct
documents stored until they add up to 12x the index's capacity in chunks and 12x the storage in
bytes, with re-stores, clears, new models (past the store's 32 layout classes), data-plane
SIGKILLs (between calls and with a store in flight) and service restarts on the way, and a
checkpoint after each disturbance and every few dozen documents. Everything is drawn from one
seed: every run stores the same documents and meets the same events in the same order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.churn import Churn, Schedule, Sizes

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SEED = 20261204
SIZES = Sizes()
SCHEDULE = Schedule()
FOLD = 12  # past the 10x the soak asks for: about 70 s on 2 cores


def test_churn_soak_keeps_every_invariant(shm_prefix: str, tmp_path: Path) -> None:
    with Churn(shm_prefix, tmp_path / "serve.log", SEED, SIZES, SCHEDULE) as churn:
        while not churn.targets_met(FOLD):
            churn.step()
        churn.checkpoint()
    c = churn.counts
    assert c.chunks >= FOLD * SIZES.fingerprint_capacity
    assert c.kv_bytes >= FOLD * (SIZES.storage_mb << 20)
    # the run met every disturbance, and the paths the checkpoint is about were taken
    assert c.clears >= 4 and c.restarts >= 6 and c.kills >= 16 and c.kills_in_flight >= 8
    assert c.models > 32 and c.restores > 120 and c.checkpoints > 75  # past the 32 layout classes
    assert c.evictions > 2000 and c.not_indexed > 0 and c.most_held > SIZES.fingerprint_capacity
    assert churn.service is not None and churn.service.errors() == []
