"""The peer's side of ``bench_matcher.py``: LMCache 0.5.6's ``BlendTokenRangeMatcher`` timed on the
same sequences and query as kvblend's index.

``bench_matcher.py`` runs this file with the peer's own interpreter (its venv has lmcache, not
kvblend) and reads one JSON line from its stdout; it imports ``sequences`` from here, so both sides
generate the same tokens from the same seeds. Nothing but numpy is imported at module level.

    PYTHON benchmarks/matcher_peer.py '{"n": ..., "chunk": ..., "query": "q.npz", ...}'
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


def sequences(n_chunks: int, chunk: int, per_seq: int, vocab: int,
              seed: int) -> Iterator[tuple[int, np.ndarray]]:
    """(index, tokens) of the registered sequences: per_seq chunks each, the last one shorter."""
    for i in range(-(-n_chunks // per_seq)):
        k = min(per_seq, n_chunks - i * per_seq)
        yield i, np.random.default_rng([seed, i]).integers(0, vocab, k * chunk, dtype=np.uint32)


@dataclass
class CBMatchResult:  # stand-in for the torch-importing custom_types module: the same five fields
    old_st: int
    old_ed: int
    cur_st: int
    cur_ed: int
    hash: bytes


def load_matcher() -> types.ModuleType:
    """LMCache's matcher module, loaded by path: its package ``__init__`` imports the whole GPU
    blend module, and its ``custom_types`` imports torch."""
    import lmcache.v1.multiprocess as mp_pkg

    shim = types.ModuleType("lmcache.v1.multiprocess.custom_types")
    shim.CBMatchResult = CBMatchResult  # type: ignore[attr-defined]
    sys.modules["lmcache.v1.multiprocess.custom_types"] = shim
    path = mp_pkg.__path__[0] + "/modules/blend/matcher.py"
    spec = importlib.util.spec_from_file_location("peer_matcher", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args: dict[str, Any]) -> dict[str, Any]:
    """Register the sequences, then time ``match_sub_sequence`` of the query."""
    mod = load_matcher()
    chunk = args["chunk"]
    q = np.load(args["query"])
    query, exp_pos, exp_seq, exp_chunk = q["query"].astype(np.uint64), q["pos"], q["seq"], q["chunk"]
    warm = mod.BlendTokenRangeMatcher(chunk_size=chunk)  # numba load/compile, untimed
    warm.on_new_token_hashes(np.arange(chunk, dtype=np.uint64), [b"w" * 16])
    warm.match_sub_sequence(np.arange(2 * chunk, dtype=np.uint64))
    del warm
    m = mod.BlendTokenRangeMatcher(chunk_size=chunk)
    reg_s = 0.0
    n_reg = 0
    for i, toks in sequences(args["n"], chunk, args["per_seq"], args["vocab"], args["seed"]):
        keys = [i.to_bytes(8, "little") + c.to_bytes(8, "little") for c in range(len(toks) // chunk)]
        t0 = time.perf_counter()
        n_reg += m.on_new_token_hashes(toks, keys)
        reg_s += time.perf_counter() - t0
    want = {(int(p), int(s).to_bytes(8, "little") + int(c).to_bytes(8, "little"))
            for p, s, c in zip(exp_pos, exp_seq, exp_chunk)}
    for _ in range(args["warmup"]):
        m.match_sub_sequence(query)
    times = []
    for _ in range(args["iters"]):
        t0 = time.perf_counter()
        res = m.match_sub_sequence(query)
        times.append(time.perf_counter() - t0)
    hits = sum((r.cur_st, r.hash) in want for r in res)
    return {"times": times, "hits": hits, "found": len(res), "registered": n_reg, "reg_s": reg_s}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
