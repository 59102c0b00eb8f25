"""The frequencies the vLLM connector registers (``engine.blend.rotary_config`` of vLLM's HF config)
are those vLLM's rotary cache was built from: vLLM computes its frequencies in float32 from the
config and rounds only the cos/sin cache to the model's dtype, so the angle of every position in
that cache, built in float32, equals the angle kvblend turns K by, for each scaling kvblend turns.
(A transformers model cast with ``.to()`` rounds its frequencies instead: ``engine.blend.
model_rotary``, ``tests/engine/test_rotation.py``.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests")

from transformers import LlamaConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from kvblend.dataplane import rotary  # noqa: E402
from kvblend.engine.blend import rotary_config  # noqa: E402
from tests.scalings import SCALINGS  # noqa: E402

MAX_POSITION = 1 << 17
POSITIONS = np.array([0, 1, 255, 4096, 30_000, MAX_POSITION - 1])


def angle_gap(cache: torch.Tensor, freqs: np.ndarray) -> np.ndarray:
    """Per position, the largest angle (rad) between vLLM's cos/sin cache and ``freqs``'s."""
    half = len(freqs)
    rows = cache[POSITIONS].double().numpy()
    theirs = np.arctan2(rows[:, half:], rows[:, :half])
    ours = rotary.angles(freqs, POSITIONS).astype(np.float64)
    return np.abs(np.angle(np.exp(1j * (theirs - ours)))).max(axis=1)


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_kvblend_turns_by_vllms_own_angles(scaling: str) -> None:
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                     rope_parameters=SCALINGS[scaling], max_position_embeddings=MAX_POSITION)
    freqs = rotary.frequencies(rotary_config(hf))
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, MAX_POSITION, True, dict(SCALINGS[scaling]), torch.float32)
    assert angle_gap(rope.cos_sin_cache, freqs).max() <= 1e-4
    # the check can tell: frequencies rounded to bf16 (as a cast transformers model has them)
    rounded = torch.from_numpy(freqs).to(torch.bfloat16).float().numpy()
    assert angle_gap(rope.cos_sin_cache, rounded)[POSITIONS >= 4096].min() > 0.01
