"""Re-rotation of K against transformers' own rotary code (the oracle): every scaling type,
partial rotary, interleaved pairs, fp32 and bf16, deltas up and down to 30,000 positions, stored
positions other than 0; and the config checks."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, PhiConfig
from transformers.models.gptj import modeling_gptj
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi.modeling_phi import apply_rotary_pos_emb as phi_apply

from kvblend.dataplane import rotary
from kvblend.dataplane.rotary import RotaryConfig

H, DH, T = 4, 64, 48

CASES = {
    "default": (RotaryConfig(head_dim=DH), {"rope_type": "default", "rope_theta": 10000.0}),
    "partial": (RotaryConfig(head_dim=DH, rotary_dim=32, theta=25000.0),
                {"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5}),
    "linear": (RotaryConfig(head_dim=DH, scaling="linear", factor=4.0),
               {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": (RotaryConfig(head_dim=DH, theta=500000.0, scaling="llama3", factor=8.0,
                            low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192),
               {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (RotaryConfig(head_dim=DH, scaling="yarn", factor=4.0,
                          original_max_position_embeddings=32768),
             {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768}),
}


def hf_k(rope: dict, k: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """K ``[T, H, DH]`` at ``positions`` as transformers computes it, in ``k``'s dtype: a Llama,
    or for partial rotary a Phi (which rotates the first ``rotary_dim`` dims of each head)."""
    if "partial_rotary_factor" in rope:
        cfg = PhiConfig(hidden_size=H * DH, num_attention_heads=H, num_key_value_heads=H,
                        partial_rotary_factor=rope["partial_rotary_factor"], rope_parameters=rope)
        emb, apply = PhiRotaryEmbedding(cfg), phi_apply
    else:
        cfg = LlamaConfig(hidden_size=H * DH, num_attention_heads=H, num_key_value_heads=H,
                          head_dim=DH, rope_parameters=rope, max_position_embeddings=4 * 32768)
        emb, apply = LlamaRotaryEmbedding(cfg), apply_rotary_pos_emb
    x = k.permute(1, 0, 2)[None]  # [1, H, T, DH]
    cos, sin = emb(x, torch.from_numpy(positions)[None])
    d = cos.shape[-1]
    _, turned = apply(x[..., :d], x[..., :d], cos, sin)
    return torch.cat((turned, x[..., d:]), -1)[0].permute(1, 0, 2).contiguous()


def gptj_k(k: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    table = modeling_gptj.create_sinusoidal_positions(int(positions.max()) + 1, DH)
    sincos = table[torch.from_numpy(positions)][None]
    sin, cos = torch.split(sincos, DH // 2, dim=-1)
    x = k[None].to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    return modeling_gptj.apply_rotary_pos_emb(x, sin.to(x.dtype), cos.to(x.dtype))[0].to(k.dtype)


def pair_ulps(got: torch.Tensor, exact: torch.Tensor, cfg: RotaryConfig) -> float:
    """The largest error of ``got`` (bf16) against ``exact``, in bf16 units in the last place of
    each rotated pair's length (a rotation's natural scale: an element near zero is the
    difference of two products of that size)."""
    d, half = cfg.dim, cfg.dim // 2
    w = exact.double()
    a, b = (w[..., :half], w[..., half:d]) if cfg.style == "neox" else (w[..., 0:d:2],
                                                                        w[..., 1:d:2])
    r = torch.sqrt(a * a + b * b)
    r = torch.cat((r, r), -1) if cfg.style == "neox" else torch.stack((r, r), -1).flatten(-2)
    ulp = torch.exp2(torch.floor(torch.log2(r.clamp(min=1e-30))) - 7)  # bf16: 8 significant bits
    assert torch.equal(got[..., d:].double(), w[..., d:].to(got.dtype).double())
    return float(((got[..., :d].double() - w[..., :d]).abs() / ulp).max())


def close(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, cfg: RotaryConfig,
          held_error: float = 0.0) -> None:
    """fp32: within 1e-5 of transformers' own K, relative to its largest element. bf16: against
    the exact (float64) K, the rotation adds at most half a unit in the last place (its one
    rounding) to the error the stored K already had (``held_error``, the largest of one
    element; a rotation keeps a pair's error length, at most sqrt(2) times that)."""
    if want.dtype == torch.bfloat16:
        assert pair_ulps(got, exact, cfg) <= 2 ** 0.5 * held_error + 0.5 + 1e-6
        assert pair_ulps(want, exact, cfg) <= 2.5  # the oracle's own bf16 error, for scale
    else:
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("old_start,delta", [(0, 517), (5, 0), (1, 30_000), (700, -650),
                                             (30_001, -30_000)])
def test_rotation_matches_transformers(case: str, dtype: torch.dtype, old_start: int,
                                       delta: int) -> None:
    cfg, rope = CASES[case]
    rotary.check(cfg)
    freqs = rotary.frequencies(cfg)
    raw = torch.randn((T, H, DH), generator=torch.Generator().manual_seed(1)).to(dtype)
    old = np.arange(old_start, old_start + T)
    new = old + delta
    stored = hf_k(rope, raw, old)           # what the data plane holds
    held = pair_ulps(stored, hf_k(rope, raw.double(), old), cfg) if dtype == torch.bfloat16 else 0
    rotary.rotate(stored, *rotary.turn(freqs, old, new), cfg)
    # what a full prefill computes at the new positions (and in float64)
    close(stored, hf_k(rope, raw, new), hf_k(rope, raw.double(), new), cfg, held)
    if case != "yarn" and dtype == torch.bfloat16:  # yarn's bf16 K is held with up to 2 ulps
        assert pair_ulps(stored, hf_k(rope, raw.double(), new), cfg) <= 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [300, -20, 30_000])
def test_interleaved_pairs_match_gptj(dtype: torch.dtype, delta: int) -> None:
    cfg = RotaryConfig(head_dim=DH, style="gptj")
    rotary.check(cfg)
    freqs = rotary.frequencies(cfg)
    raw = torch.randn((T, H, DH), generator=torch.Generator().manual_seed(2)).to(dtype)
    old = np.arange(20, 20 + T)
    stored = gptj_k(raw, old)
    held = pair_ulps(stored, gptj_k(raw.double(), old), cfg) if dtype == torch.bfloat16 else 0
    rotary.rotate(stored, *rotary.turn(freqs, old, old + delta), cfg)
    close(stored, gptj_k(raw, old + delta), gptj_k(raw.double(), old + delta), cfg, held)


@pytest.mark.parametrize("case", sorted(CASES))
def test_there_and_back_returns_the_input(case: str) -> None:
    cfg = CASES[case][0]
    rotary.check(cfg)
    freqs = rotary.frequencies(cfg)
    k = torch.randn((T, H, DH), generator=torch.Generator().manual_seed(3))
    k32 = k.clone()
    old, new = np.arange(T) + 3, np.arange(T) + 30_003
    rotary.rotate(k32, *rotary.turn(freqs, old, new), cfg)
    rotary.rotate(k32, *rotary.turn(freqs, new, old), cfg)
    # float32: within 1 ulp of the input's largest magnitude
    assert float((k32 - k).abs().max()) <= float(torch.finfo(torch.float32).eps) * float(
        k.abs().max())
    assert torch.equal(k32[..., cfg.dim:], k[..., cfg.dim:])  # dims past rotary_dim untouched


def test_own_frequencies_stand_for_the_engines_cache() -> None:
    cfg, rope = CASES["llama3"]
    own = RotaryConfig(head_dim=DH, inv_freq=rotary.frequencies(cfg).tolist())
    rotary.check(own)
    freqs = rotary.frequencies(own)
    raw = torch.randn((T, H, DH), generator=torch.Generator().manual_seed(4))
    old = np.arange(T)
    stored = hf_k(rope, raw, old)
    rotary.rotate(stored, *rotary.turn(freqs, old, old + 9000), own)
    close(stored, hf_k(rope, raw, old + 9000), hf_k(rope, raw.double(), old + 9000), own)


@pytest.mark.parametrize("bad,message", [
    (RotaryConfig(head_dim=64, rotary_dim=96), "exceeds head_dim"),
    (RotaryConfig(head_dim=64, rotary_dim=33), "must be even"),
    (RotaryConfig(head_dim=66, rotary_dim=0, style="gptj", inv_freq=[1.0] * 30), "33 needs|needs 33"),
    (RotaryConfig(head_dim=64, scaling="llama3", low_freq_factor=4.0, high_freq_factor=1.0),
     "high_freq_factor > low_freq_factor"),
    (RotaryConfig(head_dim=64, scaling="linear", factor=0.5), "factor >= 1"),
    (RotaryConfig(head_dim=64, theta=float("inf")), "not finite|self-test"),
    (RotaryConfig(head_dim=8, inv_freq=[1.0, float("nan"), 1.0, 1.0]), "not finite"),
    # positive, but yarn's ramp is infinite (an OverflowError before: a 500 over HTTP)
    (RotaryConfig(head_dim=8, scaling="yarn", beta_fast=5e-324), "cannot be computed"),
    (RotaryConfig(head_dim=8, scaling="yarn", factor=4.0, beta_slow=5e-324), "cannot be computed"),
])
def test_inconsistent_configs_are_refused(bad: RotaryConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rotary.check(bad)


def test_the_wire_form_bounds_every_field() -> None:
    dec = msgspec.json.Decoder(RotaryConfig)
    assert dec.decode(b'{"head_dim": 128, "scaling": "yarn", "factor": 4}').dim == 128
    for body in (b'{"head_dim": 128, "theta": 0}', b'{"head_dim": 128, "scaling": "ntk"}',
                 b'{"head_dim": 4096}', b'{"head_dim": 128, "style": "other"}'):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(body)
    with pytest.raises(ValueError, match="positions"):
        rotary.angles(np.ones(4, np.float32), np.array([-1]))
