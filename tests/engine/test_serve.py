"""The reference engine against a real ``kvblend serve`` (HTTP control, data-plane process): documents
precomputed and stored, a prompt holding them blended and decoded to text, the blended prompt
stored back with ``store_final``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.engine.blend import FULL, NAIVE, BlendEngine, cacheblend
from tests.engine.test_blend import V, tiny_llama
from tests.harness import Services

pytestmark = pytest.mark.slow

CHUNK = 256  # the service's default


def test_blend_through_a_real_service(services: Services) -> None:
    svc = services.start()
    try:
        rng = np.random.default_rng(7)
        a, b = rng.integers(0, V, CHUNK), rng.integers(0, V, 2 * CHUNK)
        prompt = np.concatenate([rng.integers(0, V, 5), a, rng.integers(0, V, 7), b,
                                 rng.integers(0, V, 9)])
        with BlendClient(svc.url) as client:
            eng = BlendEngine(tiny_llama(torch.float32), client, "tiny-serve", num_tokens=1024)
            assert eng.precompute(a, first_position=1).ok and eng.precompute(b).ok
            naive = eng.prefill(prompt, NAIVE)
            assert naive.hit.sum() == 3 * CHUNK and naive.failed == []
            assert naive.computed[0] == len(prompt) - 3 * CHUNK
            full_text = eng.generate(prompt, FULL, 8)
            assert eng.generate(prompt, cacheblend(1.0), 8) == full_text
            assert len(eng.generate(prompt, NAIVE, 8)) == 8
            assert eng.store_final(prompt, eng.prefill(prompt, FULL)).ok
            found = client.lookup(prompt, "tiny-serve").matches
            assert {m.origin for m in found} == {"final"}  # the prompt's own run wins
            only = client.lookup(prompt, "tiny-serve", standalone_only=True).matches
            assert [(m.cur_st, m.old_st) for m in only] == [
                (5, 1), (5 + CHUNK + 7, 0), (5 + 2 * CHUNK + 7, CHUNK)]
            eng.close()
    finally:
        assert svc.stop() == 0
