"""Fault trials: SIGKILL the data plane, the API and the supervisor of ``kvblend serve`` at random
moments while an engine stores, and count acknowledged chunks lost, torn reads, failed restarts,
kill-to-ready and leftovers (``tests/faults.py`` says how each is measured).

Targets: 0 lost, 0 torn, 0 unfindable, 0 failed restarts, 0 leftover processes and names, median
kill-to-ready <= 2 s for each kind. Exits 1 when one is missed. CI runs a short version
(``tests/test_fault_trials.py``); the figures of the full run are in docs/faults.md.

Run from the repository root: ``python benchmarks/faults.py [--dataplane 100] [--api 20]
[--supervisor 10] [--seed 9]``
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package

from tests.faults import FaultTrials  # noqa: E402
from tests.harness import remove_prefix, unique_prefix  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataplane", type=int, default=100, help="data-plane kills")
    p.add_argument("--api", type=int, default=20, help="API kills")
    p.add_argument("--supervisor", type=int, default=10,
                   help="supervisor kills, each followed by a new kvblend serve")
    p.add_argument("--seed", type=int, default=9, help="documents, KV and kill moments")
    p.add_argument("--log", type=Path, default=None,
                   help="the service's stderr (default: a temporary file, kept on failure)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the engine's client warns when a lease renewal meets the data plane restarting: expected
    logging.getLogger("kvblend.client").setLevel(logging.ERROR)
    prefix = unique_prefix("kvbf")
    log = args.log or Path(tempfile.mkstemp(prefix="kvblend-faults-", suffix=".log")[1])
    plan = {"dataplane": args.dataplane, "api": args.api, "supervisor": args.supervisor}
    print(f"prefix {prefix}; service log {log}", flush=True)
    try:
        report = FaultTrials(prefix, log, args.seed, out=lambda s: print(s, flush=True)).run(plan)
    finally:
        remove_prefix(prefix)
    print()
    print(report.table())
    problems = report.problems(speed=True)
    for line in problems:
        print(f"TARGET MISSED: {line}")
    if not problems and args.log is None:
        log.unlink()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
