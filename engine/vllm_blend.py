"""CacheBlend inside vLLM's worker: the layer loop the kvblend connector runs over vLLM's modules.

This module runs inside a vLLM worker, called by the connector's worker side
(``engine.vllm_worker``) from ``start_load_kv`` (before vLLM's forward of the step). It owns the
layer loop that turns a request's loaded chunks into the blended KV of its claimed positions
``[0, claim)``: the tokens no chunk filled (gaps: templates, separators, partial chunks, an
unstored system prompt) are computed in every layer, and the chunk rows CacheBlend selects are
recomputed from the check layer on, exactly as the reference engine selects them
(``engine.blend.select_rows``, the same mode). It does not own the claim (the connector's
scheduler side, ``engine.vllm_scheduler``), the copies (the data plane retrieves each chunk into
the request's blocks, K turned to its new position, layer by layer), nor the tokens after the
claim: vLLM's own forward computes those, attending to what this loop left in the blocks.

Per layer ``i`` of the model (``model.model.layers``, vLLM's decoder layers as they are)::

    wait for layer i of the retrieve      (layer 0: which chunks were loaded: their rows are "hit")
    read K/V of positions [0, claim)      from vLLM's paged cache, as loaded (``PagedLayer``)
    run vLLM's decoder layer i on the     input norm (with residual), qkv projection, rotary
    rows being computed                   embedding at the prompt's positions, attention, output
                                          projection, post norm, MLP: vLLM's own modules; only
                                          the attention is this module's (``_Attention``): the
                                          rows' fresh K/V replace the loaded ones, and each row
                                          attends to every position at or before it
    write the rows' K/V into their slots  the paged cache now holds the blended layer i
    a selection step after layer i?       rank the chunk rows by how far their fresh KV moved
                                          from the loaded KV (summed over tensor-parallel ranks,
                                          so every rank keeps the same rows), keep the top share

Which rows: up to the check layer every row ``[local, claim)`` (``local``: rows vLLM's own cache
already held, exact, never recomputed); after each selection step the gap rows and the chunk
rows kept. Failures never leave wrong KV behind: the loop returns the matches whose chunks did
not load in full and raises on anything else; the connector reports the affected blocks to vLLM
as load errors, and vLLM recomputes them.

NOTE: vLLM's attention module of a layer reads its metadata from the step's forward context,
which describes vLLM's batch, not these rows: during the layer's call the module is stood in for
by ``_Attention`` (the attribute is restored in a ``finally``), and nothing else of vLLM's model
is touched. Models whose decoder layers are called as ``layer(positions, hidden, residual)``
and whose attention is ``self_attn.attn`` (Llama, Mistral, Qwen2, Qwen3) are blended; others are
refused at registration (``check_model``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblend.dataplane.paged import placements
from kvblend.engine.blend import Mode, select_rows

if TYPE_CHECKING:
    from kvblend.dataplane.client import Match

QUERY_BLOCK = 512  # query rows per attention product: bounds the scores to 512 x claim per head
LAYOUTS = ("flash_attn", "flashinfer", "cpu_kt")


class PagedLayer:
    """One layer of vLLM's paged KV cache, read and written by block and slot: K and V as
    ``[blocks, block_size, kv_heads, head_dim]`` strided views of the layer's tensor, where
    ``dataplane.paged.placements`` (the one table of the layouts the data plane copies) puts
    them. Reads and writes take ``[n, kv_heads, head_dim]`` rows."""

    def __init__(self, cache: torch.Tensor, layout: str, block_size: int, kv_heads: int,
                 head_dim: int) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"no blending over vLLM's {layout!r} cache layout: one of "
                             f"{', '.join(LAYOUTS)}")
        B = cache.shape[1] if layout == "flash_attn" else cache.shape[0]
        shape = (B, block_size, kv_heads, head_dim)
        self._k, self._v = (
            cache.as_strided(shape, (p.block, p.token, p.head, p.dim),
                             cache.storage_offset() + p.offset)
            for p in placements(layout, B, block_size, kv_heads, head_dim))

    def read(self, blk: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[blk, slot], self._v[blk, slot]

    def write(self, blk: torch.Tensor, slot: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        self._k[blk, slot] = k
        self._v[blk, slot] = v


@dataclass
class BlendLoad:
    """What one request's loop needs (from the connector's metadata).

    Attributes:
        token_ids: the whole prompt.
        claim: positions ``[0, claim)`` are the connector's to fill.
        local: positions ``[0, local)`` vLLM's own cache held (exact; attended to, not computed).
        matches: the chunks retrieved, sorted by ``cur_st``.
        block_ids: the request's blocks, in position order.
    """

    token_ids: np.ndarray
    claim: int
    local: int
    matches: list[Match]
    block_ids: list[int]


@dataclass
class Blended:
    """What the loop did for one request.

    Attributes:
        first: match indexes not loaded by layer 0 (their rows were computed, as gaps).
        late: match indexes that failed after layer 0 (their rows hold KV the loop could not
            trust: the caller reports them as load errors).
        rows: the positions computed in the last layer (gaps and selected chunk rows).
        computed: rows computed, summed over the layers.
    """

    first: set[int]
    late: set[int]
    rows: np.ndarray
    computed: int


def gaps(matches: list[Match], start: int, end: int) -> list[tuple[int, int]]:
    """The spans of ``[start, end)`` no match covers, in order."""
    out, at = [], start
    for m in matches:
        if m.cur_st > at:
            out.append((at, min(m.cur_st, end)))
        at = max(at, m.cur_ed)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return [(s, e) for s, e in out if s < e]


def check_model(model: Any) -> None:
    """Refuse a model the loop cannot run (module docstring).

    Raises:
        ValueError: naming what is missing.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "embed_tokens", None) is None:
        raise ValueError(f"{type(model).__name__} has no model.layers / model.embed_tokens")
    first = layers[0]
    attn = getattr(getattr(first, "self_attn", None), "attn", None)
    if attn is None:
        raise ValueError(f"{type(first).__name__} has no self_attn.attn")
    params = list(inspect.signature(first.forward).parameters)
    if params[:3] != ["positions", "hidden_states", "residual"]:
        raise ValueError(f"{type(first).__name__}.forward takes {params}, not "
                         "(positions, hidden_states, residual)")
    if getattr(attn, "sliding_window", None) is not None:
        raise ValueError("a sliding-window attention is not blended")


class _Attention(torch.nn.Module):
    """Stands in for one layer's vLLM attention: writes the computed rows' K/V over the loaded
    K/V of ``[0, claim)`` and attends each row to every position at or before it; keeps the
    rows' deviation (squared L2 distance of the fresh K and V from the loaded) when asked."""

    def __init__(self, real: Any, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 score: str | None) -> None:
        super().__init__()
        self.H, self.Hkv, self.Dh = int(real.num_heads), int(real.num_kv_heads), int(real.head_size)
        self.scale = float(getattr(getattr(real, "impl", None), "scale", self.Dh ** -0.5))
        self.k, self.v, self.rows, self.score = k, v, rows, score
        self.dev: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        m = query.shape[0]
        k = key.reshape(m, self.Hkv, self.Dh)
        v = value.reshape(m, self.Hkv, -1)
        if self.score is not None:
            self.dev = torch.zeros(m, device=query.device)
            if self.score in ("kv", "k"):
                self.dev += ((k.float() - self.k[self.rows].float()) ** 2).sum((1, 2))
            if self.score in ("kv", "v"):
                self.dev += ((v.float() - self.v[self.rows].float()) ** 2).sum((1, 2))
        self.k[self.rows], self.v[self.rows] = k.to(self.k.dtype), v.to(self.v.dtype)
        rep = self.H // self.Hkv
        keys = self.k.transpose(0, 1).repeat_interleave(rep, 0)  # [H, claim, Dh]
        values = self.v.transpose(0, 1).repeat_interleave(rep, 0)
        q = query.reshape(m, self.H, self.Dh).transpose(0, 1)  # [H, m, Dh]
        if m == self.k.shape[0]:  # every position: the causal kernel, no mask
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale).transpose(0, 1).reshape(
                m, -1).to(query.dtype)
        at = torch.arange(self.k.shape[0], device=query.device)
        out = []
        for s in range(0, m, QUERY_BLOCK):  # row r attends to positions <= r
            mask = at[None, :] <= self.rows[s:s + QUERY_BLOCK, None]
            out.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, s:s + QUERY_BLOCK], keys, values, attn_mask=mask, scale=self.scale))
        return torch.cat(out, 1).transpose(0, 1).reshape(m, -1).to(query.dtype)


class _StandIn:
    """``module.attn`` replaced by ``stand`` inside the ``with``, restored after."""

    def __init__(self, module: Any, stand: torch.nn.Module) -> None:
        self.module, self.stand, self.real = module, stand, module.attn

    def __enter__(self) -> None:
        self.module.attn = self.stand

    def __exit__(self, *exc: Any) -> None:
        self.module.attn = self.real


def hit_rows(load: BlendLoad, failed: set[int]) -> tuple[np.ndarray, list[int]]:
    """(the prompt's rows a loaded chunk filled before the claim, where each stored run begins)."""
    n = len(load.token_ids)
    hit = np.zeros(n, bool)
    heads = []
    for j, m in enumerate(load.matches):  # heads as the reference engine's: failed or not
        prev = load.matches[j - 1] if j else None
        if prev is None or (prev.cur_ed, prev.old_ed) != (m.cur_st, m.old_st):
            heads.append(m.cur_st)
        if j not in failed:
            hit[m.cur_st:min(m.cur_ed, load.claim)] = True
    hit[:load.local] = False
    return hit, heads


def blend(model: Any, caches: list[PagedLayer], block_size: int, load: BlendLoad, mode: Mode,
          wait_layer: Callable[[int], list[int]],
          reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Blended:
    """Run the loop (module docstring) for one request.

    Args:
        caches: vLLM's cache of each decoder layer, in the model's layer order.
        wait_layer: waits until layer ``i`` of the retrieve is copied; the match indexes not
            loaded so far.
        reduce: sums a tensor over the tensor-parallel ranks (None: one rank).

    Returns:
        What was computed, and which chunks failed (``Blended``).
    """
    inner = model.model
    device = next(model.parameters()).device
    first = _failed_on_any_rank(set(wait_layer(0)), len(load.matches), device, reduce)
    hit, heads = hit_rows(load, first)
    n, claim = len(hit), load.claim
    table = torch.as_tensor(load.block_ids, dtype=torch.long, device=device)
    at = torch.arange(claim, device=device)
    blk, slot = table[at // block_size], at % block_size
    rows = torch.arange(load.local, claim, device=device)
    if mode.kind == "naive":  # the gaps only, in every layer
        rows = rows[torch.from_numpy(~hit[load.local:claim]).to(device)]
    ids = torch.as_tensor(load.token_ids[:claim], dtype=torch.long, device=device)
    h, residual = inner.embed_tokens(ids[rows]), None
    steps = mode.steps() if mode.kind in ("cacheblend", "random", "given") else {}
    late: set[int] = set()
    computed = 0
    picked: torch.Tensor | None = None  # the chunk rows the last selection step kept
    for i, layer in enumerate(inner.layers):
        if i:
            late |= set(wait_layer(i)) - first
        if not len(rows):  # nothing computed from here on (naive reuse without gaps)
            continue
        k, v = caches[i].read(blk, slot)
        stand = _Attention(layer.self_attn.attn, k, v, rows,
                           mode.score if i in steps and hit.any() else None)
        with _StandIn(layer.self_attn, stand):
            h, residual = layer(rows, h, residual)
        computed += len(rows)
        caches[i].write(blk[rows], slot[rows], k[rows], v[rows])
        if stand.dev is not None:
            dev = torch.zeros(n, device=device)
            dev[rows] = stand.dev
            if reduce is not None:
                dev = reduce(dev)
            if picked is None:  # a first step: the hit rows this request computes
                among = hit & (np.arange(n) >= load.local) & (np.arange(n) < claim)
            else:               # a later one: those the step before picked
                among = picked
            sel = select_rows(hit, among, mode, heads, steps[i], lambda: dev, device,
                              span=(load.local, claim))
            picked = sel.picked
            keep = torch.searchsorted(rows, sel.rows)
            rows, h, residual = rows[keep], h[keep], residual[keep]
    return Blended(first, late, rows.cpu().numpy(), computed)


def _failed_on_any_rank(failed: set[int], matches: int, device: torch.device,
                        reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> set[int]:
    """The match indexes some rank did not load: every rank counts a chunk only if every rank
    loaded it (one rank: its own)."""
    if reduce is None:
        return failed
    lost = torch.zeros(matches, device=device)
    lost[list(failed)] = 1.0
    return set(np.flatnonzero(reduce(lost).cpu().numpy() > 0).tolist())


__all__ = ["Blended", "BlendLoad", "PagedLayer", "blend", "check_model", "gaps", "hit_rows"]
