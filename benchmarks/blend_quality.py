"""Quality of blended prefill: a byte-level Llama trained here from scratch, scored on held-out text.

Corpus: the Python sources and docs of the installed packages (``*.py``, ``*.md``, ``*.rst``,
``*.txt`` under the interpreter's site-packages, at most 1 MB a file, read as bytes). A file is held
out when the first byte of the blake2b digest of its content is below 26 (about 10 %): the split
depends on content only, so it is the same on every run and machine with the same packages.

Training: a Llama of ``--hidden`` / ``--layers`` / GQA ``--heads`` over ``--kv-heads`` on bytes
(vocab 256), random windows of the training files, AdamW with a cosine schedule, for
``--minutes`` of wall time; the weights stay on this machine (``--save`` writes them to a local
file, ``--load`` scores from such a file without training again, for runs split in parts).

Scoring, through a ``kvblend serve`` started here and the reference engine (``engine.blend``): a
prompt is the first ``L`` bytes of a held-out file cut into documents of ``--doc-bytes``, each
prefilled alone and stored, then the file's next ``--continuation`` bytes. Each mode prefills the
prompt; the continuation is computed in every mode (no chunk covers it; each prompt has its own
cache salt), so its next-byte predictions are scored: negative log-likelihood per byte (nats) and
agreement of the argmax with full prefill's. Modes: full, naive, cacheblend at each ``--ratios``,
random selection at 15 %, and epic with the same recompute budget as cacheblend 15 %. Means over
prompts with 95 % intervals (normal approximation); the share of the naive-to-full gap a mode
closes, with a bootstrap interval over prompts.

Usage::

    python benchmarks/blend_quality.py                          # CUDA: ~10 min of training
    python benchmarks/blend_quality.py --save /tmp/q.pt --train-only   # the same in two parts
    python benchmarks/blend_quality.py --load /tmp/q.pt
    python benchmarks/blend_quality.py --device cpu --minutes 0.3 --hidden 64 --layers 2 \\
        --heads 4 --kv-heads 2 --seq 256 --batch 8 --lengths 1024 --prompts 6   # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from blend_ttft import start_service  # noqa: E402
from dataplane.client import BlendClient  # noqa: E402
from engine.blend import FULL, NAIVE, BlendEngine, Mode, cacheblend, epic, random_blend  # noqa: E402
from shm.names import destroy  # noqa: E402

SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE = 1 << 20


def corpus() -> tuple[list[bytes], list[bytes]]:
    """(training files, held-out files) of the interpreter's site-packages, sorted by path."""
    train, held = [], []
    root = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(root.rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not 0 < len(data) <= MAX_FILE:
            continue
        (held if hashlib.blake2b(data).digest()[0] < 26 else train).append(data)
    return train, held


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      max_position_embeddings=1 << 16, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).to(args.device)


def batches(data: np.ndarray, rng: np.random.Generator, seq: int, batch: int,
            device: str) -> torch.Tensor:
    """``batch`` random windows of ``seq`` bytes of ``data``."""
    starts = rng.integers(0, len(data) - seq, batch)
    return torch.from_numpy(np.stack([data[s:s + seq] for s in starts]).astype(
        np.int64)).to(device)


def train(model: Any, files: list[bytes], args: argparse.Namespace, long_seq: int) -> None:
    """AdamW for ``--minutes``; the last ``--long-share`` of the time on windows of ``long_seq``
    bytes (the same bytes a step), so that the scored prompts' positions were seen in training."""
    data = np.frombuffer(b"".join(files), np.uint8)
    rng = np.random.default_rng(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60
    t0 = time.monotonic()
    step, seen = 0, 0
    model.train()
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")
    while (elapsed := time.monotonic() - t0) < budget:
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        for g in opt.param_groups:
            g["lr"] = lr
        seq, size = args.seq, args.batch
        if elapsed >= (1 - args.long_share) * budget:
            seq, size = long_seq, max(1, args.batch * args.seq // long_seq)
        batch = batches(data, rng, seq, size, args.device)
        with autocast:  # the model shifts the labels by one itself
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, seen = step + 1, seen + batch.numel()
        if step % 500 == 0 or step == 1:
            print(f"# step {step}, {elapsed:.0f} s, {seen / 1e6:.0f} M bytes, windows of {seq}, "
                  f"train loss {loss.item():.3f} nats/byte", flush=True)
    model.eval()
    print(f"# trained {step} steps, {seen / 1e6:.0f} M bytes in {time.monotonic() - t0:.0f} s",
          flush=True)


@torch.inference_mode()
def held_out_loss(model: Any, files: list[bytes], seq: int, args: argparse.Namespace) -> float:
    """Mean next-byte NLL (nats) of the model over 16 random held-out windows of ``seq`` bytes."""
    rng = np.random.default_rng(args.seed + 1)
    data = np.frombuffer(b"".join(files), np.uint8)
    losses = [float(model(input_ids=b, labels=b).loss)
              for b in (batches(data, rng, seq, 1, args.device) for _ in range(16))]
    return float(np.mean(losses))


def score(engine: BlendEngine, prompt: np.ndarray, at: np.ndarray, mode: Mode,
          full_argmax: Any) -> tuple[float, float, np.ndarray]:
    """NLL per byte of the bytes after positions ``at`` and argmax agreement with full prefill.
    ``at``: continuation positions every mode computes (naive's rows there)."""
    p = engine.prefill(prompt, mode)
    row = {int(x): i for i, x in enumerate(p.positions)}
    logits = p.logits[[row[int(q)] for q in at]]
    target = torch.from_numpy(prompt[at + 1]).to(logits.device)
    nll = float(torch.nn.functional.cross_entropy(logits, target))
    argmax = logits.argmax(-1).cpu().numpy()
    agree = 1.0 if full_argmax is None else float((argmax == full_argmax).mean())
    return nll, agree, argmax


def interval(x: list[float]) -> str:
    a = np.asarray(x)
    half = 1.96 * a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return f"{a.mean():.4f} +- {half:.4f}"


def gap_closed(naive: list[float], mode: list[float], full: list[float], seed: int) -> str:
    n, m, f = (np.asarray(v) for v in (naive, mode, full))
    rng = np.random.default_rng(seed)

    def share(idx: np.ndarray) -> float:
        gap = (n[idx] - f[idx]).mean()
        return float((n[idx] - m[idx]).mean() / gap) if gap > 0 else float("nan")

    boots = [share(rng.integers(0, len(n), len(n))) for _ in range(1000)]
    lo, hi = np.nanpercentile(boots, [2.5, 97.5])
    return f"{share(np.arange(len(n))):+.3f} [{lo:+.3f}, {hi:+.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--minutes", type=float, default=9.0)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--long-share", type=float, default=0.3,
                   help="share of the training time on windows as long as the longest prompt")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--doc-bytes", type=int, default=512)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--ratios", default="0.05,0.15,0.30")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the trained weights to this local file")
    p.add_argument("--load", help="score the weights of this file (from --save) instead of training")
    p.add_argument("--train-only", action="store_true", help="stop after training (with --save)")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    train_files, held = corpus()
    print(f"# corpus: {len(train_files)} training files ({sum(map(len, train_files)) / 1e6:.0f} MB), "
          f"{len(held)} held out ({sum(map(len, held)) / 1e6:.0f} MB)", flush=True)
    long_seq = max(lengths) + args.continuation
    model = build_model(args)
    if args.load:
        model.load_state_dict(torch.load(args.load, map_location=args.device))
        model.eval()
        print(f"# weights from {args.load}", flush=True)
    else:
        train(model, train_files, args, long_seq)
        if args.save:
            torch.save(model.state_dict(), args.save)
    if args.device == "cuda":
        model = model.to(torch.bfloat16)
    for seq in sorted({args.seq, long_seq}):
        print(f"# held-out NLL, full prefill of {seq}-byte windows: "
              f"{held_out_loss(model, held, seq, args):.3f} nats/byte", flush=True)
    if args.train_only:
        return
    prefix = f"kvquality_{os.getpid()}"
    kv_bytes = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2
    storage = int(2 * max(lengths) * kv_bytes * 8 / (1 << 20)) + 256
    proc, url = start_service(prefix, args.device, storage)
    try:
        with BlendClient(url) as client:
            engine = BlendEngine(model, client, "bytes", num_tokens=max(lengths) +
                                 args.continuation + 16)
            budget_first = max(1, round(0.15 * args.doc_bytes))
            modes: dict[str, Mode] = {"full": FULL, "naive": NAIVE}
            modes.update({f"cacheblend {r:.0%}": cacheblend(r) for r in ratios})
            modes["random 15%"] = random_blend(0.15, seed=args.seed)
            modes[f"epic {budget_first}"] = epic(budget_first)
            for n_ctx in lengths:
                n_ctx -= n_ctx % args.doc_bytes
                usable = [f for f in held if len(f) >= n_ctx + args.continuation]
                picks = np.random.default_rng(args.seed).permutation(len(usable))[:args.prompts]
                nll: dict[str, list[float]] = {k: [] for k in modes}
                agree: dict[str, list[float]] = {k: [] for k in modes}
                t0 = time.monotonic()
                for done, i in enumerate(picks):
                    if done and done % 20 == 0:
                        print(f"# {n_ctx} bytes: {done} prompts in {time.monotonic() - t0:.0f} s",
                              flush=True)
                    text = np.frombuffer(usable[i][:n_ctx + args.continuation], np.uint8).astype(
                        np.int64)
                    engine.salt = f"{n_ctx}-{i}"  # each prompt finds its own documents only
                    for d in range(0, n_ctx, args.doc_bytes):
                        assert engine.precompute(text[d:d + args.doc_bytes]).ok
                    # the continuation's rows naive computes (all of them unless the text repeats
                    # a stored chunk), every other mode computes them too
                    rows = engine.prefill(text, NAIVE).positions
                    at = rows[(rows >= n_ctx) & (rows < len(text) - 1)]
                    full_nll, _, full_argmax = score(engine, text, at, FULL, None)
                    nll["full"].append(full_nll)
                    agree["full"].append(1.0)
                    for name, mode in modes.items():
                        if name != "full":
                            a, b, _ = score(engine, text, at, mode, full_argmax)
                            nll[name].append(a)
                            agree[name].append(b)
                print(f"\n## {n_ctx} bytes of context, {len(picks)} held-out prompts "
                      f"({time.monotonic() - t0:.0f} s)")
                print(f"{'mode':<16} {'NLL nats/byte':>20} {'agreement with full':>22} "
                      f"{'gap closed':>24}")
                for name in modes:
                    closed = ("" if name in ("full", "naive") else
                              gap_closed(nll["naive"], nll[name], nll["full"], args.seed))
                    print(f"{name:<16} {interval(nll[name]):>20} {interval(agree[name]):>22} "
                          f"{closed:>24}", flush=True)
            engine.close()
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        destroy(prefix)


if __name__ == "__main__":
    main()
