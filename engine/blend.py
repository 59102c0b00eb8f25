"""Blended prefill of a transformers causal LM (the Llama family) through kvblend: the reference engine.

This module runs inside an engine's process, on top of ``dataplane.client.BlendClient``. It owns
the layer loop over the model's own modules (embedding, rotary embedding, decoder layers, final
norm, LM head), the cache that loop reads and writes, and the choice of which tokens each layer
computes. It does not own where KV lives between requests (kvblend) nor how K is re-rotated
(``engine.rotary.KTurn`` on the engine's stream on a GPU, else the data plane on retrieve; one set
of formulas, ``dataplane.rotary``).

The engine's KV buffer is one registered ``[2, L, T, kv_heads * head_dim]`` buffer: row ``p`` holds
the K (after the rotary embedding) and V of prompt position ``p``. A prefill::

    layer 0 queued                      where the mode computes it in full (cacheblend): the
                                        device computes it while the host looks up
    lookup(prompt)                      matches: stored chunks, where they sit (cur_st)
    retrieve(matches, first_position=0) each chunk's KV into rows cur_st.., K turned to those
                                        positions; layer-wise, waiting for the device's work
                                        from before the prefill only; a layer's load is waited
                                        for where it is first read (a deviation, or a layer
                                        that computes some rows only)
    layer loop                          per layer, the rows the mode computes attend to every row
                                        at or before them (loaded or computed); the others keep
                                        the loaded KV

What each mode computes (``Mode``), over the prompt's N positions, "hit" = rows a chunk filled:

    full            every row in every layer (no lookup, no retrieve)
    naive           the rows no chunk filled, in every layer
    cacheblend(r)   every row up to the check layer (1 by default); there, the hit rows whose fresh
                    KV deviates most from the loaded KV (the top r of them, by the L2 norm of the K
                    and V differences) join the non-hit rows, which are computed in every later layer
                    (options: the deviation of K or V alone, summed over the layers up to the
                    check layer; ``widen``: gradual filtering, ``widen * r`` kept at the check
                    layer and r of them one layer later, by that layer's deviation)
    epic(k)         the non-hit rows and the first k rows of every chunk, in every layer
    random(r)       as cacheblend(r), the hit rows drawn at random (a baseline)
    given(rows)     as cacheblend, the hit rows the caller chose (an oracle, for measuring)
    DEFAULT         cacheblend(0.15) with gradual filtering (``widen=2``): what the measurements
                    on a real model favour (docs/blend.md)

The modes are ``engine.modes``'s, the selection step ``engine.select``'s and the rotary config
``engine.rotary``'s, all re-exported here. Any mode can also recompute the first ``sinks`` rows
of every stored run (the chunks stored together, in order): alone, a document's first token
draws the attention a prompt's first token draws (an attention sink); inside a prompt it should
not.

The last row (the prompt's last token) is always computed: its logits start the decode. A layer
whose rows are all of them runs with transformers' own causal mask, so ``full`` and a 100 %
``cacheblend`` equal ``model(input_ids)`` bit for bit in the model's dtype; a subset of rows
attends through an explicit mask (row at position p sees keys at positions <= p).

NOTE: the layer loop calls the model's decoder layers with this module's cache object in place of
transformers' cache (the attention calls ``cache.update(k, v, layer_idx)``, which writes the
computed rows and returns every row's K and V), so attention, MLP and norms are transformers' own
code: the engine blends whatever model shares the Llama module names (Llama, Mistral, Qwen2/3).
The cache goes in positionally: transformers 5.25 names that argument ``cache``, the 5.19 that
vLLM 0.32 pins ``past_key_values``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblend.dataplane.client import BlendClient, TransferResult
from kvblend.dataplane.messages import MAX_LAYER_GROUP_MATCHES
from kvblend.engine.modes import (DEFAULT, FULL, NAIVE, Mode, cacheblend, epic, given,
                                  random_blend)
from kvblend.engine.loads import Loads
from kvblend.engine.rotary import KTurn, model_rotary, rotary_config
from kvblend.engine.select import Selection, rows_on, select_rows, sink_rows


class _Cache:
    """Every layer's K and V ``[1, kv_heads, capacity, head_dim]``; ``update`` (called by the
    attention) writes the rows being computed and returns rows ``[0, length)``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (1, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows: Any = slice(0, 0)  # the rows being computed: a slice, or a tensor of indexes
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer_idx][:, :, self.rows] = k
        self.v[layer_idx][:, :, self.rows] = v
        return self.k[layer_idx][:, :, :self.length], self.v[layer_idx][:, :, :self.length]


@dataclass
class Prefill:
    """One prefill's result.

    Attributes:
        logits: float32 logits of the computed rows' positions in the last layer, ``[rows, vocab]``
            (every position for ``full``; the last is the prompt's last token).
        hit: prompt positions whose KV a chunk filled (``[N]`` bool).
        computed: rows computed per layer.
        failed: match indexes the retrieve did not copy (computed instead).
        cache: every layer's K and V (the decode continues from it).
        length: the prompt's tokens.
        positions: the positions of ``logits``' rows.
        times: seconds spent in ``lookup``, blocked waiting for loaded layers (``load_wait``), in
            the selection (``select``), and in all (``total``, after the device finished).
    """

    logits: torch.Tensor
    hit: np.ndarray
    computed: list[int]
    failed: list[int] = field(default_factory=list)
    cache: Any = None
    length: int = 0
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    times: dict[str, float] = field(default_factory=dict)


class BlendEngine:
    """A transformers causal LM whose prefills reuse chunks stored in kvblend.

    Args:
        model: a ``*ForCausalLM`` of the Llama family (``model.model.layers``, ``model.lm_head``).
        client: a connected ``BlendClient``.
        model_name: the kvblend namespace's model name.
        num_tokens: the engine buffer's rows: the longest prompt plus its decode.
        cache_salt: the tenant salt of every call.
        turn_here: whether the engine turns loaded K itself (``KTurn``, on its own stream) or the
            data plane does on retrieve; default: the engine when it runs on a GPU.
    """

    def __init__(self, model: Any, client: BlendClient, model_name: str, num_tokens: int,
                 cache_salt: str = "", turn_here: bool | None = None) -> None:
        cfg = model.config
        self.model, self.client, self.model_name, self.salt = model, client, model_name, cache_salt
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        D = self.kv_heads * self.head_dim
        if self.device.type == "cuda":
            self.kv = torch.zeros((2, self.layers, num_tokens, D), dtype=self.dtype,
                                  device=self.device)
        else:
            self.kv = client.cpu_kv_buffer(self.layers, num_tokens, D, self.dtype)
        self.rotary = model_rotary(model)
        self.turn_here = self.device.type == "cuda" if turn_here is None else turn_here
        self.inst = client.register_kv_cache(self.kv, model_name=model_name, rotary=self.rotary)
        #: recorded as a prefill starts: its retrieve waits for the device's work before it only
        self._begin = (torch.cuda.Event(interprocess=True) if self.device.type == "cuda"
                       else None)

    # -- storing ----------------------------------------------------------------------------

    def precompute(self, doc: Any, first_position: int = 0, prefix: Any = None
                   ) -> TransferResult:
        """Prefill ``doc`` alone at positions ``first_position..`` and store its chunks
        (``store_pre_computed``). ``prefix``: tokens prefilled before the document (at
        ``first_position..``, the document after them) and not stored, such as the token a
        prompt begins with: the document's first token is then not an attention sink."""
        ids = _ids(doc)
        pre = ids[:0] if prefix is None else _ids(prefix)
        p = self._run(torch.cat([pre, ids]), FULL, positions=first_position)
        self._to_buffer(p.cache, len(ids), start=len(pre))
        return self.client.store_pre_computed(
            self.inst, ids.numpy(), first_position=first_position + len(pre),
            cache_salt=self.salt).wait(timeout=120)

    def store_final(self, prompt: Any, prefill: Prefill) -> TransferResult:
        """Store a prefill's whole prompt (``store_final``): its KV attended to all of it."""
        ids = _ids(prompt)
        self._to_buffer(prefill.cache, len(ids))
        return self.client.store_final(self.inst, ids.numpy(), cache_salt=self.salt).wait(
            timeout=120)

    def _to_buffer(self, cache: _Cache, n: int, start: int = 0) -> None:
        """The cache's rows ``start..start+n`` into the buffer's rows ``0..n``."""
        rows = slice(start, start + n)
        for layer in range(self.layers):
            self.kv[0, layer, :n] = cache.k[layer][0, :, rows].transpose(0, 1).reshape(n, -1)
            self.kv[1, layer, :n] = cache.v[layer][0, :, rows].transpose(0, 1).reshape(n, -1)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    # -- prefill and decode -----------------------------------------------------------------

    def prefill(self, prompt: Any, mode: Mode = DEFAULT, extra: int = 0,
                standalone_only: bool = False,
                loaded: list[tuple[int, int]] | None = None) -> Prefill:
        """Prefill ``prompt`` in ``mode``; ``extra`` rows of cache are kept for the decode.
        ``loaded``: ``(start, tokens)`` spans whose KV the buffer already holds at the prompt's
        positions (no lookup, no retrieve: KV the engine loaded itself, or a timing floor)."""
        return self._run(_ids(prompt), mode, extra=extra, standalone_only=standalone_only,
                         spans=loaded)

    def generate(self, prompt: Any, mode: Mode = DEFAULT, max_new_tokens: int = 16) -> list[int]:
        """Greedy decode from the blended cache: the new token ids."""
        ids = _ids(prompt)
        p = self.prefill(ids, mode, extra=max_new_tokens)
        out = [int(p.logits[-1].argmax())]
        cache, n = p.cache, len(ids)
        for i in range(max_new_tokens - 1):
            logits = self._step(cache, out[-1], n + i)
            out.append(int(logits.argmax()))
        return out

    def _step(self, cache: _Cache, token: int, position: int) -> torch.Tensor:
        inner = self.model.model
        ids = torch.tensor([[token]], device=self.device)
        pos = torch.tensor([[position]], device=self.device)
        h = inner.embed_tokens(ids)
        pe = inner.rotary_emb(h, position_ids=pos)
        cache.rows, cache.length = pos[0], position + 1
        with torch.no_grad():
            for layer in inner.layers[:self.layers]:
                h = layer(h, None, pos, cache, position_embeddings=pe)
            return self.model.lm_head(inner.norm(h))[0, -1].float()

    def _run(self, ids: torch.Tensor, mode: Mode, positions: int = 0, extra: int = 0,
             standalone_only: bool = False, spans: list[tuple[int, int]] | None = None
             ) -> Prefill:
        n = len(ids)
        if not 0 < n <= self.kv.shape[2] - extra:
            raise ValueError(f"a prompt of {n} tokens (+{extra} to decode) does not fit the "
                             f"engine's buffer of {self.kv.shape[2]} rows")
        t0, times = time.perf_counter(), {"lookup": 0.0, "load_wait": 0.0, "select": 0.0}
        if self._begin is not None:  # the retrieve waits for the device's work up to here only
            self._begin.record()
        loads = Loads(self.kv, self.layers, self._loaded, lambda lo: self._fetch(
            lo, ids, mode, positions, standalone_only, spans), n, times)
        cache = _Cache(self.layers, self.kv_heads, self.head_dim, n + extra, self.dtype,
                       self.device)
        cache.length, hit = n, loads.hit
        pos = torch.arange(positions, positions + n, device=self.device)[None]
        inner = self.model.model
        with torch.no_grad():
            everything = inner.embed_tokens(ids.to(self.device)[None])
            cos, sin = inner.rotary_emb(everything, position_ids=pos)
            causal = _causal_mask(inner, everything, pos)
            rows: torch.Tensor | None = None  # None: every row
            picked: torch.Tensor | None = None  # the chunk rows the last step kept
            computed = []
            steps = mode.steps() if mode.kind in ("cacheblend", "random", "given") else {}
            acc = torch.zeros(n, device=self.device) if mode.accumulate else None
            h = everything
            for layer_idx, layer in enumerate(inner.layers[:self.layers]):
                # a layer computed in full reads no loaded KV: its load is waited for only where
                # the loaded KV is read (a deviation, or a layer that computes some rows only)
                if layer_idx == 0 and mode.kind in ("naive", "epic"):
                    loads.ready(0)  # the rows they compute depend on which chunks came
                    if hit.any():
                        rows = self._rows(hit, mode, loads.starts, loads.chunk, loads.heads)
                        h = everything[:, rows]
                if rows is not None:
                    loads.into_cache(cache, layer_idx)
                r: Any = slice(0, n) if rows is None else rows  # a slice writes without a scatter
                cache.rows = r
                mask = causal if rows is None else (pos[0, None, :] <= pos[0, r][:, None])[None, None]
                pe = (cos[:, r], sin[:, r])
                h = layer(h, mask, pos[:, r], cache, position_embeddings=pe)
                loads.start()  # once the first layer is queued: the lookup overlaps it
                computed.append(n if rows is None else len(rows))
                if acc is not None and 1 <= layer_idx <= mode.check_layer and rows is None:
                    loads.ready(layer_idx)
                    d = self.deviation(cache, layer_idx, n, mode.score)
                    acc += d / d.mean().clamp_min(1e-30)
                if layer_idx in steps:
                    summed = acc if layer_idx == mode.check_layer else None
                    rows, h, picked = self._select_step(cache, layer_idx, loads, mode,
                                                        steps[layer_idx], summed, rows, h, picked)
            logits = self.model.lm_head(inner.norm(h))[0].float()
            last = torch.arange(n, device=self.device) if rows is None else rows
        failed = loads.finish()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        times["total"] = time.perf_counter() - t0
        return Prefill(logits, hit, computed, failed, cache, n, last.cpu().numpy() + positions,
                       times)

    def _fetch(self, loads: Loads, ids: torch.Tensor, mode: Mode, positions: int,
               standalone_only: bool, spans: list[tuple[int, int]] | None) -> None:
        """Look the prompt up and send the retrieve of its matches (layer-wise where it may be),
        or take ``spans`` the buffer holds already: ``loads``' transfer, rows and heads."""
        t0 = time.perf_counter()
        loads.starts, loads.chunk = [s for s, _ in spans or []], [c for _, c in spans or []]
        loads.heads = list(loads.starts)
        if mode.kind == "full" or spans is not None:
            return
        matches = self.client.lookup(ids.numpy(), self.model_name, cache_salt=self.salt,
                                     standalone_only=standalone_only).matches
        loads.times["lookup"] = time.perf_counter() - t0
        if matches:
            loads.layerwise = len(matches) <= MAX_LAYER_GROUP_MATCHES
            loads.transfer = self.client.retrieve(
                self.inst, ids.numpy(), matches, offset=0, event=self._begin,
                cache_salt=self.salt, layer_groups=self.layers if loads.layerwise else 0,
                first_position=positions, rotate=not self.turn_here)
            if self.turn_here:
                loads.turn = KTurn(self.rotary, matches, positions, self.kv_heads, self.device)
        loads.starts = [m.cur_st for m in matches]
        loads.chunk = [m.cur_ed - m.cur_st for m in matches]
        loads.heads = [m.cur_st for j, m in enumerate(matches)
                       if j == 0 or (matches[j - 1].cur_ed, matches[j - 1].old_ed)
                       != (m.cur_st, m.old_st)]

    def _select_step(self, cache: _Cache, layer: int, loads: Loads, mode: Mode,
                     ratio: float, summed: torch.Tensor | None,
                     rows: torch.Tensor | None, h: torch.Tensor, picked: torch.Tensor | None
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """A selection step after ``layer`` (``select_rows``, by this layer's ``deviation``
        unless ``summed``), among the hit rows (a first step) or the rows the step before
        picked: the rows computed from now on (None: every row), their hidden states, and the
        chunk rows picked."""
        loads.ready(layer)  # the deviation reads it; the hit rows are known
        hit = loads.hit
        if not hit.any():
            return rows, h, picked

        def deviation() -> torch.Tensor:
            return self.deviation(cache, layer, len(hit), mode.score) if summed is None else summed
        w = time.perf_counter()
        sel = select_rows(hit, hit if picked is None else picked, mode, loads.heads, ratio,
                          deviation, self.device)
        loads.times["select"] += time.perf_counter() - w
        if len(sel.rows) == len(hit):  # every row: keep transformers' own mask
            return rows, h, sel.picked
        keep = sel.rows if rows is None else torch.searchsorted(rows, sel.rows)
        return sel.rows, h[:, keep], sel.picked

    def _loaded(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the buffer's K and V of ``layer``, rows ``[0, n)``, as ``[kv_heads, n,
        head_dim]`` (the cache's order)."""
        return tuple(self.kv[kv, layer, :n].reshape(n, self.kv_heads, self.head_dim)
                     .transpose(0, 1) for kv in (0, 1))  # type: ignore[return-value]

    def _rows(self, hit: np.ndarray, mode: Mode, starts: list[int], chunk: list[int],
              heads: list[int]) -> torch.Tensor:
        """The rows naive and epic compute in every layer."""
        want = sink_rows(hit, mode, heads)
        if mode.kind == "epic":
            for s, c in zip(starts, chunk):
                if hit[s]:
                    want[s:s + min(mode.first, c)] = True
        return rows_on(np.flatnonzero(want), self.device)

    def deviation(self, cache: _Cache, layer: int, n: int, score: str = "kv") -> torch.Tensor:
        """Per row ``[0, n)``, the squared L2 distance of ``cache``'s K and V (``score``) of
        ``layer`` from the KV the buffer holds (loaded by the last retrieve)."""
        loaded_k, loaded_v = self._loaded(layer, n)
        dev = torch.zeros(n, device=self.device)
        if score in ("kv", "k"):
            dev += ((cache.k[layer][0, :, :n].float() - loaded_k.float()) ** 2).sum((0, 2))
        if score in ("kv", "v"):
            dev += ((cache.v[layer][0, :, :n].float() - loaded_v.float()) ** 2).sum((0, 2))
        return dev

    def close(self) -> None:
        """Unregister the engine's buffer."""
        self.client.unregister(self.inst)


def _ids(tokens: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(tokens, dtype=np.int64))


def _causal_mask(inner: Any, embeds: torch.Tensor, pos: torch.Tensor) -> Any:
    """transformers' own mask of a whole prefill (None where the attention uses is_causal)."""
    from transformers.masking_utils import create_causal_mask
    return create_causal_mask(inner.config, embeds, None, None, pos)


__all__ = ["BlendEngine", "Mode", "Prefill", "DEFAULT", "FULL", "NAIVE", "cacheblend", "epic",
           "random_blend", "given", "model_rotary", "rotary_config", "select_rows", "Selection",
           "sink_rows"]