"""The remote tier's value digest: the hashes it could use, on one value, side by side in one run.

    python benchmarks/remote_digest.py [--mib 32] [--rounds 7]

Hashes one value of ``--mib`` MiB of random bytes with each candidate and prints milliseconds per
value and GB/s (best of ``--rounds``): SHA-256 unkeyed (format 1's digest), HMAC-SHA256 (format
2's, ``dataplane.remoteformat``), keyed BLAKE2b and keyed BLAKE2s. The digest is on the write path
and the read path of every chunk, so the fastest keyed one wins (docs/remote.md).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import time
from collections.abc import Callable


def best_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    data, key = os.urandom(args.mib << 20), os.urandom(32)
    cases: dict[str, Callable[[], object]] = {
        "SHA-256, unkeyed (format 1)": lambda: hashlib.sha256(data).digest(),
        "HMAC-SHA256 (format 2)": lambda: hmac.new(key, data, hashlib.sha256).digest(),
        "BLAKE2b, keyed": lambda: hashlib.blake2b(data, key=key, digest_size=16).digest(),
        "BLAKE2s, keyed": lambda: hashlib.blake2s(data, key=key, digest_size=16).digest(),
    }
    print(f"| digest | ms per {args.mib} MiB | GB/s |\n|---|---|---|")
    for name, fn in cases.items():
        s = best_s(fn, args.rounds)
        print(f"| {name} | {s * 1e3:.1f} | {len(data) / s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
