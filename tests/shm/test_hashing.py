"""Chunk keys: deterministic, prefix-chained, full chunks only, separated by namespace."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvblend.shm.hashing import DIGEST_BYTES, Namespace, as_tokens, chunk_hashes

REPO = Path(__file__).resolve().parents[2]
NS = Namespace("llama-3-8b", world_size=2, cache_salt="tenant-a")


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def test_keys_follow_the_documented_chain() -> None:
    toks = _tokens(12)
    prev = NS.root
    want = []
    for i in range(3):
        prev = hashlib.blake2b(prev + toks[4 * i:4 * i + 4].astype("<u4").tobytes(),
                               digest_size=DIGEST_BYTES).digest()
        want.append(prev)
    assert chunk_hashes(NS, toks, 4) == want
    assert all(len(k) == 16 for k in want)


def test_a_change_reaches_every_later_key_only() -> None:
    toks = _tokens(16)
    base = chunk_hashes(NS, toks, 4)
    first = toks.copy()
    first[1] ^= 1
    changed = chunk_hashes(NS, first, 4)
    assert all(a != b for a, b in zip(base, changed))
    last = toks.copy()
    last[13] ^= 1
    assert chunk_hashes(NS, last, 4)[:3] == base[:3]
    assert chunk_hashes(NS, last, 4)[3] != base[3]


def test_partial_last_chunk_is_ignored() -> None:
    toks = _tokens(10)
    assert chunk_hashes(NS, toks, 4) == chunk_hashes(NS, toks[:8], 4)
    assert len(chunk_hashes(NS, toks, 4)) == 2
    assert chunk_hashes(NS, toks[:3], 4) == []


def test_namespaces_differ() -> None:
    toks = _tokens(8)
    variants = [Namespace("m"), Namespace("m2"), Namespace("m", world_size=2),
                Namespace("m", cache_salt="s")]
    keys = [chunk_hashes(ns, toks, 4)[0] for ns in variants]
    assert len(set(keys)) == len(keys)
    assert len({ns.root for ns in variants}) == len(variants)
    assert Namespace("m") == Namespace("m") and Namespace("m").id == Namespace("m").id


@pytest.mark.slow
def test_same_keys_in_another_process_with_another_hash_seed() -> None:
    toks = _tokens(64, seed=3)
    here = [k.hex() for k in chunk_hashes(NS, toks, 16)]
    script = (
        "import sys, numpy as np\n"
        "from shm.hashing import Namespace, chunk_hashes\n"
        "toks = np.array([int(x) for x in sys.argv[1].split(',')], np.uint32)\n"
        "ns = Namespace('llama-3-8b', world_size=2, cache_salt='tenant-a')\n"
        "print(' '.join(k.hex() for k in chunk_hashes(ns, toks, 16)))\n")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script, ",".join(map(str, toks.tolist()))],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == here


def test_lists_and_arrays_give_equal_keys() -> None:
    toks = _tokens(8)
    assert chunk_hashes(NS, toks.tolist(), 4) == chunk_hashes(NS, toks.astype(np.int64), 4)


@pytest.mark.parametrize("bad", [[-1, 2], [2**32, 1], [1.5, 2.0]])
def test_tokens_out_of_range_are_rejected(bad: list) -> None:
    with pytest.raises(ValueError):
        as_tokens(bad)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        chunk_hashes(NS, [1, 2], 0)
    with pytest.raises(ValueError):
        Namespace("")
    with pytest.raises(ValueError):
        Namespace("m", world_size=0)


def test_a_chain_computed_in_pieces_equals_the_whole() -> None:
    ns = Namespace("m")
    tokens = np.arange(10 * 4, dtype=np.uint32)
    whole = chunk_hashes(ns, tokens, 4)
    first = chunk_hashes(ns, tokens[:12], 4)
    assert first + chunk_hashes(ns, tokens[12:], 4, parent=first[-1]) == whole
