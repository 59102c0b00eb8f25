"""Rotary position embeddings: a model's rotary config, its frequencies, and re-rotating K.

A chunk's K was computed at positions ``old .. old+C``; placed at ``new .. new+C`` it must be rotated
by the angle between the two positions, per frequency (V carries no position). This module owns
the check that refuses an inconsistent config (``RotaryConfig``, declared in
``dataplane.registration``), the frequencies of each scaling type, and the rotation itself on
CPU tensors.

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

NOTE: the formulas are written once (``_formulas``) over numpy or torch arrays. ``check`` runs them
in float64 numpy and imports no torch: a registration is answered on the data plane's connection
thread, and a first torch import there (seconds) made a registration outlast the API's timeout.
The turn uses ``frequencies``, the same formulas in float32 torch: numpy's float32 power differs
from torch's by 1-2 ulps, which a position of 30,000 turns into 2e-3 rad.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kvblend.dataplane.messages import MAX_POSITION
from kvblend.dataplane.registration import RotaryConfig


def torch_dtype(name: str) -> Any:
    """The torch dtype of a ``shm.layout.DType`` name."""
    import torch
    return {"FLOAT16": torch.float16, "BFLOAT16": torch.bfloat16, "FLOAT32": torch.float32}[name]


def check(cfg: RotaryConfig) -> None:
    """Refuse a config that does not add up, or whose probe fails: the frequencies must be
    finite and positive, and a probe vector turned by +30,000 positions and back must return.
    Imports no torch (float64 numpy).

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
    with np.errstate(all="ignore"):
        try:
            f = (np.asarray(cfg.inv_freq, np.float64) if cfg.inv_freq is not None else
                 _formulas(cfg, np.arange(0, d, 2) / d, np.arange(d // 2, dtype=np.float64),
                           np.where, lambda x: np.clip(x, 0, 1)))
        except ArithmeticError as exc:  # a yarn ramp of a tiny beta is infinite: floor(inf)
            raise ValueError(f"the config's frequencies cannot be computed ({exc})") from None
        if not (np.isfinite(f).all() and (f > 0).all()):
            raise ValueError("the config gives frequencies that are not finite and positive")
        probe = np.random.default_rng(0).standard_normal(d)
        delta = 30_000 * f
        there = _turn_pair(probe, np.cos(delta), np.sin(delta), cfg.style)
        back = _turn_pair(there, np.cos(-delta), np.sin(-delta), cfg.style)
    if not np.allclose(back, probe, rtol=1e-9, atol=1e-9):
        raise ValueError("the rotary config failed its self-test (a probe vector turned by "
                         "+30000 positions and back did not return)")


def _turn_pair(x: np.ndarray, c: np.ndarray, s: np.ndarray, style: str) -> np.ndarray:
    """``x`` (``d`` dims) turned pair by pair, float64."""
    half = len(x) // 2
    a, b = (x[:half], x[half:]) if style == "neox" else (x[0::2], x[1::2])
    ra, rb = a * c - b * s, b * c + a * s
    return np.concatenate((ra, rb)) if style == "neox" else np.stack((ra, rb), -1).ravel()


def frequencies(cfg: RotaryConfig) -> np.ndarray:
    """``f_i`` as float32, ``rotary_dim / 2`` of them, computed as the models compute them."""
    d = cfg.dim
    if cfg.inv_freq is not None:
        return np.asarray(cfg.inv_freq, np.float32)
    import torch
    exps = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    f = _formulas(cfg, exps, torch.arange(d // 2, dtype=torch.float32), torch.where,
                  lambda x: torch.clamp(x, 0, 1))
    return f.to(torch.float32).numpy()


def _formulas(cfg: RotaryConfig, exps: Any, dims: Any, where: Callable[..., Any],
              clamp01: Callable[[Any], Any]) -> Any:
    """The frequencies of ``cfg`` over an array type: ``exps`` = ``(0, 2, .., d-2) / d``,
    ``dims`` = ``(0, 1, .., d/2 - 1)`` (float), ``where`` and ``clamp01`` of that type."""
    pos_freqs = cfg.theta ** exps
    base = 1.0 / pos_freqs
    if cfg.scaling == "none":
        return base
    if cfg.scaling == "linear":
        return base / cfg.factor
    old = cfg.original_max_position_embeddings
    if cfg.scaling == "llama3":
        low_wavelen, high_wavelen = old / cfg.low_freq_factor, old / cfg.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = where(wavelen > low_wavelen, base / cfg.factor, base)
        s = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        blended = (1 - s) * scaled / cfg.factor + s * scaled
        between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return where(between, blended, scaled)
    d, theta = cfg.dim, cfg.theta  # yarn

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    keep = 1 - clamp01((dims - lo) / (hi - lo))  # 1: extrapolate (high frequencies), 0: scale
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def angles(freqs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``fl32(p * f_i)`` for each position, ``[len(positions), len(freqs)]`` float32."""
    p = np.asarray(positions, np.int64)
    if p.size and (p.min() < 0 or p.max() >= MAX_POSITION):
        raise ValueError(f"positions must lie in [0, {MAX_POSITION})")
    return p.astype(np.float32)[:, None] * freqs[None, :]


def turn(freqs: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[Any, Any]:
    """float32 torch ``cos`` and ``sin`` of each token's turn from ``old`` to ``new``,
    ``[n, d/2]``."""
    import torch
    delta = angles(freqs, new).astype(np.float64) - angles(freqs, old).astype(np.float64)
    return (torch.from_numpy(np.cos(delta).astype(np.float32)),
            torch.from_numpy(np.sin(delta).astype(np.float32)))


def turn_on(freqs: np.ndarray, old: np.ndarray, new: np.ndarray, device: Any) -> tuple[Any, Any]:
    """``turn`` computed by torch on ``device`` (an engine turning K on its own stream): the
    same float32 angles, their difference and ``cos``/``sin`` in float64, rounded to float32.

    Raises:
        ValueError: a position outside ``[0, MAX_POSITION)``.
    """
    import torch
    for p in (old, new):
        if len(p) and (p.min() < 0 or p.max() >= MAX_POSITION):
            raise ValueError(f"positions must lie in [0, {MAX_POSITION})")
    f = torch.as_tensor(np.asarray(freqs, np.float32), device=device)

    def angle(p: np.ndarray) -> Any:  # fl32(p * f_i), as float64
        at = torch.as_tensor(np.asarray(p, np.int64), device=device).to(torch.float32)
        return (at[:, None] * f[None, :]).to(torch.float64)
    delta = angle(new) - angle(old)
    return delta.cos().to(torch.float32), delta.sin().to(torch.float32)


class Turn:
    """The turn of a batch of chunks: token ``c`` of chunk ``j`` from position ``old[j, c]`` to
    ``new[j, c]`` (int64 ``[chunks, C]``), by the model's float32 frequencies ``freqs``. A GPU
    computes the angles in its kernel (``dataplane.cuda_rotary``); a CPU buffer takes
    ``cos_sin``, computed once for every group of layers."""

    def __init__(self, freqs: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self.freqs, self.old, self.new = freqs, old, new
        self._cos_sin: tuple[Any, Any] | None = None

    def cos_sin(self) -> tuple[Any, Any]:
        """float32 torch ``cos`` and ``sin`` ``[chunks, C, d/2]``."""
        if self._cos_sin is None:
            cos, sin = turn(self.freqs, self.old.ravel(), self.new.ravel())
            self._cos_sin = (cos.view(*self.old.shape, -1), sin.view(*self.old.shape, -1))
        return self._cos_sin


def rotate(k: Any, cos: Any, sin: Any, cfg: RotaryConfig) -> None:
    """Turn ``k`` (a torch tensor ``[..., tokens, heads, head_dim]``, any float dtype) in place by
    ``cos``/``sin`` (``[tokens, d/2]``, from ``turn``)."""
    import torch
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


__all__ = ["RotaryConfig", "Turn", "torch_dtype", "check", "frequencies", "angles", "turn",
           "turn_on", "rotate", "MAX_POSITION"]
