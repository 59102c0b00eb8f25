"""Every copy shape against its target in one table: the rows of three benchmarks, several runs.

Runs ``bench_dataplane.py`` (contiguous 32 MiB and 3 MiB chunks, a call's fixed cost),
``bench_paged.py`` (the FlashAttention layout, layer 0 first) and ``blend_ttft.py`` (the 15 %
blend at 8k and 16k tokens against its floor) ``--runs`` times, taking them in turn (run 1 of
each, then run 2 of each: a machine that drifts moves them alike), reads the rows each prints and
prints one Markdown table: every run's value, the median, the target and whether the median
meets it (on CUDA; ``--backend cpu`` runs small shapes, without targets). Rows without a target
(the calls until their copies completed, a call's fixed cost) are printed beside them, and every
other row the benchmarks print after them. Each benchmark's own output goes to ``--log``;
progress goes to stderr.

Usage::

    python benchmarks/copy_targets.py                 # on a GPU: three runs of each, about 5 min
    python benchmarks/copy_targets.py --runs 5 --log /tmp/copy_targets.log
    python benchmarks/copy_targets.py --backend cpu   # a smoke run (no GPU: the default there)
    python benchmarks/copy_targets.py --order-events  # calls ordered by interprocess events
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))

#: the benchmarks and their arguments, per backend
COMMANDS = {
    "cuda": [("bench_dataplane.py", "--layouts", "llama8b,small", "--iters", "7", "--fixed-cost"),
             ("bench_paged.py", "--iters", "7"),
             ("blend_ttft.py", "--lengths", "8192,16384", "--ratios", "0.15", "--iters", "5",
              "--turn", "engine")],
    "cpu": [("bench_dataplane.py", "--backend", "cpu", "--layouts", "small", "--chunks", "16",
             "--iters", "3", "--storage-gib", "1", "--fixed-cost"),
            ("bench_paged.py", "--backend", "cpu", "--layers", "4", "--tokens", "2048",
             "--iters", "3", "--storage-gib", "1"),
            ("blend_ttft.py", "--device", "cpu", "--model", "tiny", "--lengths", "1024",
             "--doc-tokens", "256", "--question", "32", "--ratios", "0.15", "--iters", "2",
             "--turn", "engine")],
}


@dataclass(frozen=True)
class Target:
    """A row of the table: its key in what the benchmarks print, and its target (None: shown
    beside the others, no target)."""

    key: str
    label: str
    at_least: float | None = None
    at_most: float | None = None
    fmt: str = "{:.3f}"

    def met(self, value: float) -> str:
        if self.at_least is not None:
            return "yes" if value >= self.at_least else "no"
        if self.at_most is not None:
            return "yes" if value <= self.at_most else "no"
        return ""

    @property
    def wanted(self) -> str:
        if self.at_least is not None:
            return f">= {self.at_least:g}"
        return f"<= {self.at_most:g}" if self.at_most is not None else ""


TARGETS = [
    Target("llama8b store", "32 MiB chunks, store (share of copy_)", at_least=0.95),
    Target("llama8b retrieve", "32 MiB chunks, retrieve", at_least=0.95),
    Target("llama8b both", "32 MiB chunks, both directions at once"),
    Target("small store", "3 MiB chunks, one caller, store", at_least=0.92),
    Target("small retrieve", "3 MiB chunks, one caller, retrieve", at_least=0.92),
    Target("small store ready", "3 MiB chunks, one caller, store until its copies completed"),
    Target("small retr. ready", "3 MiB chunks, one caller, retrieve until its copies completed"),
    Target("small store x4", "3 MiB chunks, 4 calls in flight, store", at_least=0.95),
    Target("small retrieve x4", "3 MiB chunks, 4 calls in flight, retrieve", at_least=0.95),
    Target("small retrieve fixed", "3 MiB chunks, a retrieve's cost besides its bytes (µs)",
           fmt="{:.0f}"),
    Target("small retrieve leaves", "what 0.92 leaves such a call (µs)", fmt="{:.0f}"),
    Target("paged store", "paged (16-token blocks), one store", at_least=0.92),
    Target("paged retrieve", "paged, one retrieve", at_least=0.92),
    Target("paged layer-wise", "paged, layer-wise retrieve, whole call", at_least=0.92),
    Target("paged layer 0", "paged, layer 0 readable after (ms)", at_most=1.5,
           fmt="{:.2f}"),
    Target("blend 8192", "15 % blend at 8k, share of its floor's speedup", at_least=0.90),
    Target("blend 8192 speedup", "the same, speedup against full prefill (x)", fmt="{:.2f}"),
    Target("blend 8192 floor", "its floor's speedup against full prefill (x)", fmt="{:.2f}"),
    Target("blend 16384", "15 % blend at 16k, share of its floor's speedup", at_least=0.93),
    Target("blend 16384 speedup", "the same, speedup against full prefill (x)", fmt="{:.2f}"),
]

_DATAPLANE = re.compile(r"^(\w+)\s+[\d.]+\s+(.+?)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+[\d.]+$")
_FIXED = re.compile(r"^#\s+(\w+) retrieve: a call costs (-?\d+) us .* leaves (\d+) us")
_PAGED = re.compile(r"^(store|retrieve|layer-wise)\s+[\d.]+\s+[\d.]+\s+([\d.]+)$")
_LAYER0 = re.compile(r"^layer-wise: layer 0 readable after ([\d.]+) ms")
_BLEND = re.compile(r"^\s*(\d+)\s+[\d.]+\s+[\d.]+\s+\w+\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)"
                    r"\s+([\d.]+)\s")


def read_rows(lines: Iterable[str]) -> dict[str, float]:
    """The values of ``TARGETS``' keys that the benchmarks' output holds."""
    got: dict[str, float] = {}
    for line in lines:
        if m := _FIXED.match(line):
            got[f"{m[1]} retrieve fixed"], got[f"{m[1]} retrieve leaves"] = float(m[2]), float(m[3])
        elif m := _LAYER0.match(line):
            got["paged layer 0"] = float(m[1])
        elif m := _PAGED.match(line):
            got[f"paged {m[1]}"] = float(m[2])
        elif m := _BLEND.match(line):
            got[f"blend {m[1]}"] = float(m[4])
            got[f"blend {m[1]} speedup"], got[f"blend {m[1]} floor"] = float(m[2]), float(m[3])
        elif (m := _DATAPLANE.match(line)) and not line.startswith("#"):
            got[f"{m[1]} {m[2]}"] = float(m[3])
    return got


def run_one(argv: tuple[str, ...], log: str | None) -> list[str]:
    """One benchmark's output lines (its stderr with them); raises when it fails."""
    cmd = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = out.stdout + out.stderr
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(argv)}\n{text}\n")
    if out.returncode:
        raise SystemExit(f"{argv[0]} exited with {out.returncode}:\n{text[-3000:]}")
    return text.splitlines()


def table(runs: list[dict[str, float]], targets: bool) -> list[str]:
    """The Markdown table of ``TARGETS`` over ``runs`` (rows no run printed are left out; the
    target columns only where ``targets``), then every other row the benchmarks printed."""
    lines = ["| row | runs | median | target | met |", "|---|---|---:|---:|---|"]
    for t in TARGETS:
        values = [r[t.key] for r in runs if t.key in r]
        if values:
            med = statistics.median(values)
            lines.append(f"| {t.label} | {' / '.join(t.fmt.format(v) for v in values)} | "
                         f"{t.fmt.format(med)} | {t.wanted if targets else ''} | "
                         f"{t.met(med) if targets else ''} |")
    named = {t.key for t in TARGETS}
    for key in sorted({k for r in runs for k in r} - named):  # the rest, as the benchmarks say
        values = [r[key] for r in runs if key in r]
        lines.append(f"| {key} | {' / '.join(f'{v:g}' for v in values)} | "
                     f"{statistics.median(values):g} | | |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("auto", *sorted(COMMANDS)), default="auto",
                   help="auto: cuda where a GPU is visible, else cpu")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--log", default=None, help="append every benchmark's own output here")
    p.add_argument("--order-events", action="store_true",
                   help="the transfer benchmarks order their calls by interprocess events, not "
                        "by order words (dataplane.streamword, the client's default)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.backend == "auto":
        import torch
        args.backend = "cuda" if torch.cuda.is_available() else "cpu"
    runs: list[dict[str, float]] = []
    device = ""
    for i in range(args.runs):
        got: dict[str, float] = {}
        for argv in COMMANDS[args.backend]:
            if args.order_events and argv[0] in ("bench_dataplane.py", "bench_paged.py"):
                argv = (*argv, "--order-events")
            t0 = time.perf_counter()
            lines = run_one(argv, args.log)
            device = device or next((ln[len("# device: "):] for ln in lines
                                     if ln.startswith("# device: ")), "")
            got.update(read_rows(lines))
            print(f"run {i + 1}/{args.runs}: {argv[0]} in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        runs.append(got)
    print(f"# {device or args.backend}; runs of each benchmark, in turn: {args.runs}")
    print("\n".join(table(runs, targets=args.backend == "cuda")))


if __name__ == "__main__":
    main()
