"""Rotary position embeddings: a model's rotary config, its frequencies, and re-rotating K.

A chunk's K was computed at positions ``old .. old+C``; placed at ``new .. new+C`` it must be rotated
by the angle between the two positions, per frequency (V carries no position). This module owns
the config an engine registers (``RotaryConfig``), the check that refuses an inconsistent one, the
frequencies of each scaling type, and the rotation itself on CPU tensors (the CUDA data plane's
kernel follows the same math).

Frequencies, for ``d = rotary_dim`` and ``i = 0, 2, ..., d-2`` (float32, as the models compute
them)::

    none      f_i = 1 / theta^(i/d)
    linear    f_i / factor
    llama3    f_i where its wavelength 2*pi/f_i < original_max / high_freq_factor; f_i / factor
              where it is > original_max / low_freq_factor; in between a linear blend of the two
              by s = (original_max / wavelength - low_freq_factor) / (high - low_freq_factor)
    yarn      a blend of f_i (extrapolation) and f_i / factor (interpolation) by a ramp over the
              dimensions between the correction dims of beta_fast and beta_slow rotations within
              original_max positions (floored / ceiled when truncate); yarn's attention factor
              scales K at every position alike, so it cancels out of a re-rotation
    inv_freq  the engine's own frequencies (its cos/sin cache is cos/sin of position x f_i)

A token's angles are ``a_i(p) = fl32(p * f_i)``: a float32 product, exactly as the models
compute them before ``cos``/``sin``. Re-rotating from ``old`` to ``new`` turns each pair by
``a_i(new) - a_i(old)``, taken in float64 (the difference of the two float32 angles the model would
have used, so positions of 128k tokens lose nothing to the subtraction), with float64 ``cos`` and
``sin`` rounded to float32; the pair's arithmetic is float32 and the result is written back in the
buffer's dtype. Pairs: ``neox`` (half split) rotates dims ``(j, j + d/2)``, ``gptj`` (interleaved)
``(2j, 2j + 1)``; dims past ``rotary_dim`` (partial rotary) are left as they are.
"""

from __future__ import annotations

import math
import numpy as np
import torch

from dataplane.messages import MAX_POSITION, RotaryConfig

def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``shm.layout.DType`` name."""
    return {"FLOAT16": torch.float16, "BFLOAT16": torch.bfloat16, "FLOAT32": torch.float32}[name]


def check(cfg: RotaryConfig) -> np.ndarray:
    """The config's frequencies, once the config is consistent and a probe passes.

    The probe rotates a vector by +delta then -delta (it must come back) and compares one
    rotation with the pair formula computed directly in float64.

    Raises:
        ValueError: naming what is wrong (the API answers 422).
    """
    d = cfg.dim
    if d > cfg.head_dim:
        raise ValueError(f"rotary_dim {d} exceeds head_dim {cfg.head_dim}")
    if d % 2 or cfg.head_dim % 2:
        raise ValueError(f"rotary_dim ({d}) and head_dim ({cfg.head_dim}) must be even")
    if cfg.inv_freq is not None and len(cfg.inv_freq) != d // 2:
        raise ValueError(f"inv_freq has {len(cfg.inv_freq)} frequencies; rotary_dim {d} needs "
                         f"{d // 2}")
    if cfg.scaling == "llama3" and not cfg.high_freq_factor > cfg.low_freq_factor:
        raise ValueError("llama3 scaling needs high_freq_factor > low_freq_factor")
    if cfg.scaling in ("linear", "llama3", "yarn") and cfg.factor < 1:
        raise ValueError(f"{cfg.scaling} scaling needs factor >= 1, got {cfg.factor}")
    f = frequencies(cfg)
    if not (np.isfinite(f).all() and (f > 0).all()):
        raise ValueError("the config gives frequencies that are not finite and positive")
    _probe(cfg, f)
    return f


def frequencies(cfg: RotaryConfig) -> np.ndarray:
    """``f_i`` as float32, ``rotary_dim / 2`` of them."""
    d = cfg.dim
    if cfg.inv_freq is not None:
        return np.asarray(cfg.inv_freq, np.float32)
    exps = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    pos_freqs = cfg.theta ** exps
    base = 1.0 / pos_freqs
    if cfg.scaling == "none":
        f = base
    elif cfg.scaling == "linear":
        f = base / cfg.factor
    elif cfg.scaling == "llama3":
        f = _llama3(cfg, base)
    else:
        f = _yarn(cfg, pos_freqs)
    return f.to(torch.float32).numpy()


def _llama3(cfg: RotaryConfig, base: torch.Tensor) -> torch.Tensor:
    old = cfg.original_max_position_embeddings
    low_wavelen, high_wavelen = old / cfg.low_freq_factor, old / cfg.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / cfg.factor, base)
    s = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    blended = (1 - s) * scaled / cfg.factor + s * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, blended, scaled)


def _yarn(cfg: RotaryConfig, pos_freqs: torch.Tensor) -> torch.Tensor:
    d, theta, old = cfg.dim, cfg.theta, cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def angles(freqs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``fl32(p * f_i)`` for each position, ``[len(positions), len(freqs)]`` float32."""
    p = np.asarray(positions, np.int64)
    if p.size and (p.min() < 0 or p.max() >= MAX_POSITION):
        raise ValueError(f"positions must lie in [0, {MAX_POSITION})")
    return p.astype(np.float32)[:, None] * freqs[None, :]


def turn(freqs: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` of each token's turn from ``old`` to ``new``, ``[n, d/2]``."""
    delta = angles(freqs, new).astype(np.float64) - angles(freqs, old).astype(np.float64)
    return (torch.from_numpy(np.cos(delta).astype(np.float32)),
            torch.from_numpy(np.sin(delta).astype(np.float32)))


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: RotaryConfig) -> None:
    """Turn ``k`` (``[tokens, heads, head_dim]``, any float dtype) in place by ``cos``/``sin``
    (``[tokens, d/2]``, from ``turn``)."""
    d, half = cfg.dim, cfg.dim // 2
    part = k[..., :d]
    x = part.to(torch.float32)
    if cfg.style == "neox":
        a, b = x[..., :half], x[..., half:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    ra, rb = a * c - b * s, b * c + a * s
    out = torch.cat((ra, rb), -1) if cfg.style == "neox" else torch.stack((ra, rb), -1).flatten(-2)
    part.copy_(out.to(k.dtype))


def _probe(cfg: RotaryConfig, freqs: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    v = torch.from_numpy(rng.standard_normal((1, 1, cfg.head_dim)).astype(np.float32))
    w = v.clone()
    old, new = np.array([3]), np.array([30_003])
    rotate(w, *turn(freqs, old, new), cfg)
    # the same turn from the pair formula in float64
    half = cfg.dim // 2
    idx = (np.arange(half), np.arange(half) + half) if cfg.style == "neox" else \
        (np.arange(0, cfg.dim, 2), np.arange(1, cfg.dim, 2))
    delta = (angles(freqs, new).astype(np.float64) - angles(freqs, old))[0]
    x = v[0, 0].double().numpy()
    want = x.copy()
    want[idx[0]] = x[idx[0]] * np.cos(delta) - x[idx[1]] * np.sin(delta)
    want[idx[1]] = x[idx[1]] * np.cos(delta) + x[idx[0]] * np.sin(delta)
    back = w.clone()
    rotate(back, *turn(freqs, new, old), cfg)
    if not (np.allclose(w[0, 0].double().numpy(), want, rtol=1e-5, atol=1e-5) and
            torch.allclose(back, v, rtol=1e-5, atol=1e-5)):
        raise ValueError("the rotary config failed its self-test (a probe vector turned by +30000 "
                         "and back did not return)")


__all__ = ["RotaryConfig", "torch_dtype", "check", "frequencies", "angles", "turn", "rotate", "MAX_POSITION"]
