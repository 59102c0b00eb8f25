"""Schema fuzzing of the whole service: schemathesis against the live ``/openapi.json`` of
``kvblend serve``.

This module owns how a fuzz run is set up and read: a real service (supervisor, data plane, API
through its lifespan) on a private shm prefix, with or without an API token; one engine instance
registered through ``BlendClient`` with a real CPU buffer, so the instance routes have something
to find; schemathesis with every check, generation derandomized; and the run's outcome read from
schemathesis's JSON report and its HAR log of every request.

``tests/api/test_fuzz.py`` runs it bounded, in CI. The long run (docs/fuzzing.md) is
``python -m tests.api.fuzzing``, never part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvblend.dataplane.client import BlendClient
from tests.harness import Service, remove_prefix, unique_prefix

TOKEN = "fuzz-api-token"
ADMIN = "fuzz-admin-token"

# What a schema cannot say: whether an shm buffer by that name exists and belongs to the caller,
# or whether a CUDA buffer fits a CPU data plane (registerInstance); that a binary body holds
# whole uint32 ids, and that a label is at most 120 *bytes* of printable text (lookup). A
# schema-valid request may be refused 422 there (besides schemathesis's defaults); everywhere else
# positive data must pass. A 5xx fails ``not_a_server_error`` whatever this list says.
RULES = """\
[cache]
enabled = false

[[operations]]
include-operation-id = ["registerInstance", "lookup"]
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]
"""


def config(token: str | None, seed: int | None = None) -> str:
    """The schemathesis configuration of a run.

    Args:
        token: presented as the bearer token, when set.
        seed: random generation from this seed; None derandomizes it (the same requests on
            every run, as CI needs).
    """
    head = "" if seed is None else f"seed = {seed}\n"
    head += "\n[generation]\ndatabase = \"none\"\n"
    head += f"deterministic = {'true' if seed is None else 'false'}\n\n"
    auth = "" if token is None else f'\n[auth.openapi.bearer]\nbearer = "{token}"\n'
    return head + RULES + auth


def fuzz_service(prefix: str, log: Path, token: str | None = None,
                 admin: str | None = None) -> Service:
    """One ``kvblend serve`` on ``prefix``, ready; its stderr (every log line of the supervisor,
    the data plane and the API) goes to ``log``, emptied first (``logged_errors`` reads it whole).

    Args:
        prefix: the shm prefix (the caller's own).
        log: file that receives the service's stderr.
        token: the API token, or None for an open service.
        admin: the admin token, or None.
    """
    log.write_bytes(b"")
    return Service(prefix, log=log, token=token,
                   env={"KVBLEND_ADMIN_TOKEN": admin} if admin is not None else None)


@contextmanager
def engine(service: Service) -> Iterator[int]:
    """An engine attached for the whole run: a registered CPU buffer, its lease renewed;
    yields the instance id."""
    with BlendClient(service.url, api_token=service.token) as client:
        kv = client.cpu_kv_buffer(num_layers=2, num_tokens=1024, hidden_dim=8,
                                  dtype=torch.float16)
        yield client.register_kv_cache(kv, model_name="fuzz-model")


@dataclass(frozen=True)
class FuzzRun:
    """The outcome of one schemathesis run.

    Attributes:
        exit_code: schemathesis's exit code (0: every check passed).
        report: its JSON report (operations, test cases, failures and errors by kind).
        statuses: how many responses had each HTTP status, from its HAR log.
        output: what it printed (the failures, each with a curl line to reproduce it).
    """

    exit_code: int
    report: dict[str, Any]
    statuses: collections.Counter[int]
    output: str

    @property
    def requests(self) -> int:
        """HTTP requests sent and answered."""
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        """Responses with a 5xx status."""
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> str:
        """One line: requests, statuses, test cases, failures."""
        cases = self.report["test_cases"]
        return (f"{self.requests} requests {dict(sorted(self.statuses.items()))}, "
                f"{cases['generated']} test cases, {len(self.report['failures'])} kinds of "
                f"failure, {len(self.report['errors'])} kinds of error, exit {self.exit_code}")


def schemathesis_argv() -> list[str]:
    """The schemathesis command of this environment."""
    script = Path(sys.executable).with_name("schemathesis")
    return [str(script)] if script.exists() else [sys.executable, "-m", "schemathesis.cli"]


def fuzz(service: Service, max_examples: int, workdir: Path, timeout: float,
         seed: int | None = None) -> FuzzRun:
    """Run schemathesis against ``service``'s live schema, every check, every phase.

    Args:
        service: the running service (its token, if any, is presented as the bearer token).
        max_examples: test cases per operation and phase (the stateful phase scales with it).
        workdir: where the configuration and reports go.
        timeout: seconds the run may take before it is killed (a hang guard, far above normal).
        seed: see ``config``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "schemathesis.toml"
    cfg.write_text(config(service.token, seed))
    report, har = workdir / "report.json", workdir / "requests.har"
    proc = subprocess.run(
        [*schemathesis_argv(), "--config-file", str(cfg), "run", f"{service.url}/openapi.json",
         "--checks", "all", "--mode", "all", "--max-examples", str(max_examples),
         "--workers", "1", "--request-timeout", "30", "--no-color",
         "--report", "json,har", "--report-json-path", str(report),
         "--report-har-path", str(har)],
        cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
    if not report.exists():
        raise RuntimeError(f"schemathesis wrote no report (exit {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = collections.Counter(int(e["response"]["status"]) for e in entries)
    return FuzzRun(proc.returncode, json.loads(report.read_text()), statuses,
                   proc.stdout + proc.stderr)


def logged_errors(log: Path) -> list[str]:
    """The service's ERROR lines and tracebacks (a 5xx other than 503/504 logs one)."""
    return [line for line in log.read_text(errors="replace").splitlines()
            if line.startswith(("ERROR", "Traceback"))]


def main() -> int:
    """The long run: both services (open, and with API and admin tokens), one after the other."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=None,
                        help="random generation from this seed (default: derandomized, as CI)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvblend-fuzz"))
    parser.add_argument("--timeout", type=float, default=6 * 3600)
    args = parser.parse_args()
    failed = False
    for name, token, admin in (("open", None, None), ("token", TOKEN, ADMIN)):
        prefix = unique_prefix("kvbfz")
        workdir = args.workdir / name
        workdir.mkdir(parents=True, exist_ok=True)
        service = fuzz_service(prefix, workdir / "serve.log", token, admin)
        try:
            with engine(service):
                run = fuzz(service, args.max_examples, workdir, args.timeout, args.seed)
        finally:
            service.stop()
            remove_prefix(prefix)
        errors = logged_errors(workdir / "serve.log")
        print(f"{name}: {run.summary()}; {len(errors)} error lines in the service's log")
        print(json.dumps(run.report["failures"], indent=1))
        failed |= run.exit_code != 0 or run.server_errors > 0 or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
