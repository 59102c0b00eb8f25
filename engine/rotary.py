"""The rotary config a model registers with kvblend, so that K is turned as the model rotates it:
the formula (``rotary_config``, from the transformers config) and the model's own frequencies
(``model_rotary``, from its ``inv_freq`` buffer, in its dtype); and the turn of loaded K on the
engine's own stream (``KTurn``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from kvblend.dataplane import rotary
from kvblend.dataplane.registration import RotaryConfig
from kvblend.engine import turn_kernel

log = logging.getLogger("kvblend.engine")
_reported: set[str] = set()  # the frequency dtypes already reported in the log


def rotary_config(config: Any) -> RotaryConfig:
    """The kvblend rotary config of a transformers model config (``rope_parameters``).

    Raises:
        ValueError: a rotary type kvblend does not turn (dynamic NTK, longrope, ...).
    """
    rope = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    partial = float(rope.get("partial_rotary_factor",
                             getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    kind = rope.get("rope_type", "default")
    scaling = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}.get(kind)
    if scaling is None:
        raise ValueError(f"rope_type {kind!r} is not one kvblend re-rotates")
    extra: dict[str, Any] = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "truncate"):
        if rope.get(name) is not None:
            extra[name] = rope[name]
    if rope.get("original_max_position_embeddings") is not None:
        extra["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return RotaryConfig(head_dim=head_dim, rotary_dim=int(head_dim * partial),
                        theta=float(rope.get("rope_theta", 10000.0)), scaling=scaling, **extra)


def model_rotary(model: Any) -> RotaryConfig:
    """The rotary config of a transformers model as it really runs: ``rotary_config`` of its
    config, with the frequencies of its rotary module's ``inv_freq`` buffer, in the buffer's dtype.

    ``model.to(torch.bfloat16)`` also casts that buffer, so the model rotates with frequencies
    rounded to bf16 (for rope theta 1e5 up to 0.33 % off: at position 4,096 a pair's angle moves
    by up to 5.7 rad). K turned with the exact frequencies of ``theta`` would sit at other angles
    than the model's own, further off the further a chunk moves. Every scaling is in the buffer
    already. A buffer of lower precision than float32 is reported once per dtype in the log.

    Raises:
        ValueError: a rotary type kvblend does not turn (``rotary_config``), or a rotary module
            whose frequencies do not fit the config.
    """
    cfg = rotary_config(model.config)
    inner = getattr(model, "model", model)
    inv_freq = getattr(getattr(inner, "rotary_emb", None), "inv_freq", None)
    if inv_freq is None:
        return cfg
    if inv_freq.numel() != cfg.dim // 2:
        raise ValueError(f"the rotary module has {inv_freq.numel()} frequencies; rotary_dim "
                         f"{cfg.dim} needs {cfg.dim // 2}")
    if inv_freq.dtype != torch.float32 and str(inv_freq.dtype) not in _reported:
        _reported.add(str(inv_freq.dtype))
        log.warning("the model's rotary frequencies are %s (the model was cast): K is turned "
                    "with those rounded frequencies, as the model rotates", inv_freq.dtype)
    return msgspec.structs.replace(cfg, inv_freq=inv_freq.detach().float().cpu().tolist())


class KTurn:
    """K of a retrieve's chunks turned by the engine, layer by layer on its own stream, from the
    positions each chunk was computed at (its match's ``old_st``) to the prompt's
    (``first_position + cur_st``): the data plane copies them unturned (``rotate=False``).

    On a GPU this keeps every kernel of a prefill in the engine's CUDA context: the data plane's
    turning kernels run in another context, and the GPU takes turns between contexts (time
    slices) instead of running the two side by side (docs/benchmarks.md). The angles are the
    data plane's (``dataplane.rotary.turn_on``: the same formulas), so either side turns alike.
    """

    def __init__(self, cfg: RotaryConfig, matches: Sequence[Any], first_position: int,
                 heads: int, device: torch.device) -> None:
        old = np.concatenate([np.arange(m.old_st, m.old_ed) for m in matches])
        rows = np.concatenate([np.arange(m.cur_st, m.cur_ed) for m in matches])
        self.cfg, self.heads = cfg, heads
        self.rows = torch.as_tensor(rows, device=device)
        self.cos, self.sin = rotary.turn_on(rotary.frequencies(cfg), old, first_position + rows,
                                            device)

    def layer(self, kv: torch.Tensor, layer: int) -> None:
        """Turn K of ``layer`` of the buffer ``kv`` (``[2, L, T, heads * head_dim]``) in place,
        after the work queued on the current stream (the layer's load): in one fused pass where
        ``engine.turn_kernel`` runs (a GPU with Triton), else step by step in torch (the same
        bits; also where Triton cannot build or launch the kernel, ``turn_kernel`` says)."""
        if turn_kernel.available(kv) and kv.stride(-1) == 1:
            try:
                turn_kernel.turn_rows(kv[0, layer], self.rows, self.cos, self.sin, self.heads,
                                      self.cfg.head_dim, self.cfg.dim, self.cfg.style == "gptj")
                return
            except turn_kernel.KernelUnavailable:
                pass  # logged once; the torch steps turn it, now and later
        self.steps(kv, layer)

    def steps(self, kv: torch.Tensor, layer: int) -> None:
        """``layer``'s turn step by step in torch: gather the chunks' rows, turn, scatter."""
        k = kv[0, layer, self.rows]  # a copy of the chunks' rows
        rotary.rotate(k.view(len(self.rows), self.heads, -1), self.cos, self.sin, self.cfg)
        kv[0, layer, self.rows] = k


__all__ = ["rotary_config", "model_rotary", "KTurn"]
