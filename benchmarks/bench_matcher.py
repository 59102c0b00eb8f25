"""Blend matcher benchmark: lookup latency and registration throughput, side by side with a peer.

For each index size (registered chunks, chunk size 256) it registers synthetic sequences of 64 chunks,
builds a 32k-token query holding 30 of the stored chunks at unaligned offsets, and times ``match``.
With ``--peer PYTHON`` the same data goes through LMCache 0.5.6's ``BlendTokenRangeMatcher`` in a
subprocess run by that interpreter (its own venv; ``matcher_peer.py``), and the table shows both and
their ratio.

    python benchmarks/bench_matcher.py --peer .peer/venv/bin/python

The peer's venv is not part of the repository; build it once with the commands of ``PEER_SETUP``
(docs/benchmarks.md shows the same). Without ``--peer`` the peer columns stay empty and the run
says so; a ``--peer`` that cannot import LMCache's matcher stops the run before it starts, with
those commands.

Both sides generate the tokens from the same seeds (numpy ``default_rng``), so they index the same
sequences; the query and the expected hits travel to the peer as a small ``.npz`` file. Each side gets
its query as a numpy array (the peer's own conversion of a Python list is not timed). Registration
time covers the index call only; chunk keys are computed beforehand, as the store does at write time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.matcher_peer import sequences  # noqa: E402
from kvblend.shm.fingerprint import FingerprintIndex  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402

CHUNK = 256
PER_SEQ = 64
VOCAB = 128_256  # a Llama-3 sized vocabulary
SEED = 20260
NS = Namespace("bench-model")
PEER = Path(__file__).resolve().with_name("matcher_peer.py")  # run by the peer's interpreter
PEER_SETUP = """\
python3 -m venv .peer/venv
.peer/venv/bin/pip install numpy numba msgspec
.peer/venv/bin/pip install --no-deps lmcache==0.5.6"""
NO_PEER = ("no --peer: the peer columns stay empty. To compare with LMCache 0.5.6's matcher, "
           "build its venv once:\n" + PEER_SETUP + "\nthen add --peer .peer/venv/bin/python")


def check_peer(python: str) -> None:
    """Stop at once, saying how to build the peer, when ``python`` cannot import LMCache."""
    if not os.access(python, os.X_OK):
        reason = f"{python} is not an executable"
    else:
        out = subprocess.run([python, "-c", "import lmcache.v1.multiprocess"],
                             capture_output=True, text=True, cwd=tempfile.gettempdir())
        if out.returncode == 0:
            return
        last = (out.stderr.strip().splitlines() or ["no error text"])[-1]
        reason = f"{python} cannot import lmcache ({last})"
    sys.exit(f"--peer: {reason}\nbuild the peer's venv (from the repository root) with:\n"
             f"{PEER_SETUP}")


def build_query(n_chunks: int, q_len: int, n_hits: int, rng: np.random.Generator):
    """A random query with ``n_hits`` stored chunks at unaligned offsets, and where they are."""
    query = rng.integers(0, VOCAB, q_len, dtype=np.uint32)
    picks = rng.choice(n_chunks, n_hits, replace=False)
    span = q_len // n_hits
    pos, seq, chunk = [], [], []
    for slot, g in enumerate(sorted(picks)):
        s, c = divmod(int(g), PER_SEQ)
        k = min(PER_SEQ, n_chunks - s * PER_SEQ)
        toks = np.random.default_rng([SEED, s]).integers(0, VOCAB, k * CHUNK, dtype=np.uint32)
        p = slot * span + int(rng.integers(1, span - CHUNK))
        query[p:p + CHUNK] = toks[c * CHUNK:(c + 1) * CHUNK]
        pos.append(p)
        seq.append(s)
        chunk.append(c)
    return query, np.array(pos), np.array(seq), np.array(chunk)


def _warm_kernels() -> None:
    """Load (or compile) the numba kernels outside the timed region."""
    with FingerprintIndex.open(f"kvbench_{os.getpid()}_w", CHUNK, capacity=16, wipe=True) as idx:
        toks = np.arange(CHUNK, dtype=np.uint32)
        keys = chunk_hashes(NS, toks, CHUNK)
        idx.register(NS, toks, keys)
        idx.match(NS, np.arange(2 * CHUNK, dtype=np.uint32))
        idx.remove(keys)
        idx.unlink()


def run_ours(n_chunks: int, query: np.ndarray, pos, seq, chunk, iters: int, warmup: int) -> dict:
    _warm_kernels()
    prefix = f"kvbench_{os.getpid()}"
    idx = FingerprintIndex.open(prefix, CHUNK, capacity=n_chunks, wipe=True)
    try:
        reg_s, n_reg = 0.0, 0
        want_keys = {}
        for i, toks in sequences(n_chunks, CHUNK, PER_SEQ, VOCAB, SEED):
            keys = chunk_hashes(NS, toks, CHUNK)
            t0 = time.perf_counter()
            n_reg += idx.register(NS, toks, keys).new
            reg_s += time.perf_counter() - t0
            for p, s, c in zip(pos, seq, chunk):
                if s == i:
                    want_keys[(int(p), keys[c])] = True
        for _ in range(warmup):
            idx.match(NS, query)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            res = idx.match(NS, query)
            times.append(time.perf_counter() - t0)
        hits = sum((m.cur_st, m.chunk_hash) in want_keys for m in res)
        return {"times": times, "hits": hits, "found": len(res), "registered": n_reg,
                "reg_s": reg_s}
    finally:
        idx.unlink()
        idx.close()


def run_peer(python: str, n_chunks: int, qfile: str, iters: int, warmup: int) -> dict:
    args = {"n": n_chunks, "chunk": CHUNK, "per_seq": PER_SEQ, "vocab": VOCAB, "seed": SEED,
            "query": qfile, "iters": iters, "warmup": warmup}
    env = dict(os.environ, LMCACHE_LOG_LEVEL="WARNING")
    out = subprocess.run([os.path.abspath(python), str(PEER), json.dumps(args)], capture_output=True, text=True,
                         env=env, cwd=tempfile.gettempdir(), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"peer failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(r: dict) -> dict:
    t = np.array(r["times"]) * 1e3
    return {"median_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99)),
            "hits": r["hits"], "found": r["found"], "reg_per_s": r["registered"] / r["reg_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000", help="registered chunks, comma list")
    ap.add_argument("--query-tokens", type=int, default=32768)
    ap.add_argument("--hits", type=int, default=30)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1, help="repeat everything; report the medians")
    ap.add_argument("--peer", metavar="PYTHON", help="interpreter with lmcache==0.5.6 installed")
    ap.add_argument("--json", metavar="PATH", help="also write the raw summaries here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.peer:
        check_peer(args.peer)
    else:
        print(NO_PEER, file=sys.stderr, flush=True)
    rows = []
    for n in sizes:
        rng = np.random.default_rng([SEED, n])
        query, pos, seq, chunk = build_query(n, args.query_tokens, args.hits, rng)
        with tempfile.NamedTemporaryFile(suffix=".npz", delete=False) as f:
            np.savez(f, query=query, pos=pos, seq=seq, chunk=chunk)
            qfile = f.name
        try:
            ours, peer = [], []
            for _ in range(args.runs):
                ours.append(summarize(run_ours(n, query, pos, seq, chunk, args.iters, args.warmup)))
                if args.peer:
                    peer.append(summarize(run_peer(args.peer, n, qfile, args.iters, args.warmup)))
                print(f"  n={n}: ours {ours[-1]}" + (f"\n          peer {peer[-1]}" if peer else ""),
                      file=sys.stderr, flush=True)
        finally:
            os.unlink(qfile)
        rows.append((n, _median(ours), _median(peer) if peer else None))
    _print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _print_table(rows: list, args: argparse.Namespace) -> None:
    print(f"\nquery {args.query_tokens} tokens holding {args.hits} stored chunks, chunk {CHUNK}; "
          f"{args.iters} lookups per size, median of {args.runs} run(s)\n")
    head = (f"{'chunks':>9} | {'kvblend med':>11} {'p99':>7} {'hits':>6} | "
            f"{'peer med':>9} {'p99':>7} {'hits':>6} | {'speedup':>7} | "
            f"{'kvblend reg/s':>13} {'peer reg/s':>10}")
    print(head)
    print("-" * len(head))
    for n, o, p in rows:
        ph = f"{p['median_ms']:9.3f} {p['p99_ms']:7.3f} {p['hits']:>3.0f}/{args.hits}" if p else \
            f"{'-':>9} {'-':>7} {'-':>6}"
        ratio = f"{p['median_ms'] / o['median_ms']:6.1f}x" if p else f"{'-':>7}"
        preg = f"{p['reg_per_s']:10.0f}" if p else f"{'-':>10}"
        print(f"{n:>9} | {o['median_ms']:11.3f} {o['p99_ms']:7.3f} {o['hits']:>3.0f}/{args.hits} | "
              f"{ph} | {ratio} | {o['reg_per_s']:13.0f} {preg}")
    print("\nlatencies in ms; hits = expected (cur_st, chunk) pairs returned")
    if not args.peer:
        print("peer columns empty: run with --peer (see the top of this run's output)")


if __name__ == "__main__":
    main()
