"""Fault trials: SIGKILL the data plane, the API and the supervisor of a real ``kvblend serve``
while an engine stores, and count what the service lost.

This module owns the trial harness that ``tests/test_fault_trials.py`` (a few trials, in CI) and
``benchmarks/faults.py`` (the full run of docs/faults.md) share. Every random choice comes from one
seed: the documents, their KV, the kill moments and the documents re-checked after each trial.

What runs::

    kvblend serve --backend cpu      one service on a private prefix (stderr appended to a log)
    engine thread                    one BlendClient with one CPU instance: looks each new document
                                     up, then stores it, sent again after any failure until a
                                     store of it is acknowledged (``wait()`` returned ok); PACE_S
                                     of "compute" between documents
    this thread                      the trials, one after another:

    resume the engine -> its next acknowledgement (the client works) -> the engine sends its next
    store (API trials: its next lookup) -> a seeded delay in [0, KILL_WINDOW], about two round
    trips of that call -> SIGKILL -> poll until ready (kill-to-ready) -> the engine's next
    acknowledgement (its client recovered) -> pause the engine -> check the documents
    acknowledged since the last check and a seeded sample of earlier ones (all of them after a
    supervisor trial and at the end)

What "ready" is after each kind of kill:

    dataplane    /readyz 200 and ``GET /v1/status`` names a data plane pid other than the killed one
                 (the supervisor restarts it)
    api          /readyz 200 from an API process other than the killed one (the supervisor
                 restarts it)
    supervisor   its children exit on their own (``PR_SET_PDEATHSIG``) within CHILD_EXIT_DEADLINE;
                 then a new ``kvblend serve`` on the same prefix and port answers /readyz 200

What is counted (each a target of 0):

    lost         acknowledged chunks the store does not hold after recovery. The store is sized so
                 that nothing is evicted; a run in which anything was evicted is reported invalid.
    torn         held acknowledged chunks whose retrieve is not byte-exact (each document's KV is
                 drawn from the seed as float16 bits, any pattern), or not delivered at all
    unfindable   held acknowledged chunks that a lookup of their document does not report
    failed       restarts not ready within START_DEADLINE (or ``kvblend serve`` exited), or after
                 which the engine's client got no store acknowledged within START_DEADLINE
    leftovers    processes of the prefix alive CHILD_EXIT_DEADLINE after their supervisor was
                 killed; after the final SIGTERM, any process of the prefix and any name under it
                 but the cache a clean stop keeps (``shm.names``); after ``destroy``, any name

A store cut off by a kill (``DataPlaneUnavailable`` from ``wait()``) is not acknowledged and not a
loss; the engine sends it again. Kill-to-ready is measured by polling every POLL_S; it is reported,
never asserted by the CI test.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import DataPlaneError, DataPlaneUnavailable
from kvblend.dataplane.settings import ENV
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.lock import pid_alive
from kvblend.shm.matches import Match
from kvblend.shm.names import Names, destroy
from kvblend.shm.private import SHM_DIR
from kvblend.shm.store import ChunkKey, Store
from tests.harness import PollTimeout, Service, free_port, poll

T = TypeVar("T")

CHUNK = 64
LAYERS, HIDDEN = 1, 16                # a chunk is 4 KiB of KV: 29,000 fit in 128 MiB
BUFFER_TOKENS = 8192
CHECK_AT = 512                        # stores use [0, CHECK_AT) of the buffer, checks the rest
MAX_DOC_CHUNKS = 4
MODEL = "fault-model"
SERVE_FLAGS = ["--backend", "cpu", "--chunk-size", str(CHUNK), "--storage-mb", "128",
               "--page-mb", "1", "--min-slot-kb", "4", "--fingerprint-capacity", "65536",
               "--log-level", "info"]
START_DEADLINE = 120.0       # a restart not ready by then failed
CHILD_EXIT_DEADLINE = 60.0   # children of a killed supervisor still alive by then are leftovers
CALL_TIMEOUT = 60.0          # one store, retrieve or lookup
KILL_WINDOW = 0.002          # seconds after a call is sent in which its kill falls (a store
                             # takes about 0.75 ms from send to acknowledgement, a lookup 1.3 ms)
PACE_S = 0.02                # the engine's compute between two documents
POLL_S = 0.02                # readiness poll interval (the resolution of kill-to-ready)
SAMPLE_OLD = 16              # earlier documents re-checked after each trial
KINDS = ("dataplane", "api", "supervisor")
READY_TARGET_S = 2.0         # median kill-to-ready (benchmarks only)


class TrialError(RuntimeError):
    """The harness itself cannot go on (not a finding about the service)."""


# -- documents ---------------------------------------------------------------------------------


def doc_tokens(seed: int, doc: int) -> np.ndarray:
    """Token ids of document ``doc``: 1 to MAX_DOC_CHUNKS full chunks, half of them with a tail."""
    rng = np.random.default_rng((seed, doc, 1))
    n = int(rng.integers(1, MAX_DOC_CHUNKS + 1)) * CHUNK
    n += int(rng.integers(1, CHUNK)) if rng.random() < 0.5 else 0
    return rng.integers(0, 1 << 31, n, dtype=np.uint32)


def doc_kv(seed: int, doc: int, num_tokens: int) -> torch.Tensor:
    """The KV of the document's first ``num_tokens`` tokens as int16 bits of ``[2, L, n, D]``
    float16: any bit pattern, so a copy that converts, rounds or shifts anything shows."""
    rng = np.random.default_rng((seed, doc, 2))
    bits = rng.integers(-(1 << 15), 1 << 15, (2, LAYERS, num_tokens, HIDDEN), np.int16)
    return torch.from_numpy(bits)


def doc_hashes(seed: int, doc: int) -> list[bytes]:
    return chunk_hashes(Namespace(MODEL), doc_tokens(seed, doc), CHUNK)


# -- processes ---------------------------------------------------------------------------------


def within(check: Callable[[], T | None], deadline_s: float) -> T | None:
    """``check()``'s first truthy value, polled every POLL_S (the resolution of kill-to-ready);
    None after ``deadline_s``: a trial counts that, it does not stop."""
    try:
        return poll(check, deadline_s, "a trial's condition", every_s=POLL_S)
    except PollTimeout:
        return None


def _proc_pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for p in _proc_pids():
        stat = _read(f"/proc/{p}/stat")
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid and pid_alive(p):
            out.append(p)
    return out


def processes_of(prefix: str) -> list[int]:
    """Live processes of the service on ``prefix``: ``--shm-prefix prefix`` on their command line
    (the supervisor), ``KVBLEND_SHM_PREFIX=prefix`` in their environment (the API) or settings
    in ``KVBLEND_DP_SETTINGS`` that name it (the data plane)."""
    flag = b"\0" + prefix.encode() + b"\0"
    return [p for p in _proc_pids() if p != os.getpid() and pid_alive(p) and
            (flag in _read(f"/proc/{p}/cmdline") + b"\0" or _env_prefix(p) == prefix)]


def _env_prefix(pid: int) -> str | None:
    """The prefix a process's environment names: the API's variable, the data plane's settings."""
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        name, _, value = item.partition(b"=")
        if name == b"KVBLEND_SHM_PREFIX":
            return value.decode(errors="replace")
        if name == ENV.encode():
            try:
                return str(json.loads(value)["shm_prefix"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def describe(pid: int) -> str:
    """A process's command line, parent and signal masks (``/proc/<pid>/status``)."""
    argv = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    status = _read(f"/proc/{pid}/status").decode(errors="replace").splitlines()
    masks = [line.replace("\t", " ") for line in status
             if line.split(":")[0] in ("State", "PPid", "SigPnd", "ShdPnd", "SigBlk", "SigCgt")]
    return f"pid {pid} [{argv[:160]}] " + ", ".join(masks)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def load_average() -> str:
    return " ".join(_read("/proc/loadavg").decode().split()[:3])


# -- the service -------------------------------------------------------------------------------


class TrialService(Service):
    """One ``kvblend serve`` on ``prefix`` and ``port``, returned at once (a trial times how soon
    it is ready); its stderr is appended to ``log``."""

    def __init__(self, prefix: str, port: int, log: Path) -> None:
        super().__init__(prefix, port=port, defaults=SERVE_FLAGS, log=log, wait=False)

    def api_pid(self) -> int | None:
        """The API process: the supervisor's child that runs uvicorn."""
        for p in children_of(self.proc.pid):
            if b"uvicorn" in _read(f"/proc/{p}/cmdline"):
                return p
        return None


# -- the engine --------------------------------------------------------------------------------


class Engine:
    """An engine worker on its own thread: while resumed, looks each new document up and stores
    it from the start of its buffer, then computes for PACE_S (a wait that a pause cuts short);
    a document is stored again, every POLL_S, until a store of it is acknowledged.

    Each lookup and store sent is numbered (``sent``) and its outcome kept (``outcome``), so a
    kill aimed at one call can tell whether it cut that call off.

    Attributes:
        acked: documents acknowledged, in order.
        cut_off: stores sent and then cut off by a kill (``DataPlaneUnavailable`` from ``wait``).
        refused: stores that could not be sent (no data plane to connect to).
        errors: any other failure of a store, or of the engine, by kind.
    """

    def __init__(self, url: str, seed: int) -> None:
        self.seed = seed
        self.client = BlendClient(url, timeout=CALL_TIMEOUT)
        self.kv = self.client.cpu_kv_buffer(LAYERS, BUFFER_TOKENS, HIDDEN, torch.float16)
        self.instance = self.client.register_kv_cache(self.kv, model_name=MODEL)
        self.acked: list[int] = []
        self.cut_off = self.refused = self.lookup_failures = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.sent: collections.Counter[str] = collections.Counter()   # "lookup", "store"
        self.outcome: dict[tuple[str, int], bool] = {}
        self._cond = threading.Condition()
        self._want = self._busy = self._stop = False
        self._looked_up = -1
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def resume(self) -> None:
        with self._cond:
            self._want = True
            self._cond.notify_all()

    def pause(self) -> None:
        """Until the engine finished its current call and stopped."""
        with self._cond:
            self._want = False
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: not self._busy, CALL_TIMEOUT + 10):
                raise TrialError(f"the engine did not pause within {CALL_TIMEOUT + 10} s")

    def wait_acks(self, n: int, timeout: float) -> bool:
        """True once ``n`` documents are acknowledged, False after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.acked) >= n, timeout)

    def next_call(self, what: str, timeout: float) -> int | None:
        """Until the engine is about to send its next ``what`` ("lookup" or "store"); returns
        that call's number, None after ``timeout``."""
        with self._cond:
            seq = self.sent[what] + 1
            ok = self._cond.wait_for(lambda: self.sent[what] >= seq, timeout)
            return self.sent[what] if ok else None

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(CALL_TIMEOUT + 10)
        self.client.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._want or self._stop)
                if self._stop:
                    return
                self._busy = True
            try:
                acked = self._attempt(len(self.acked))
            except Exception as exc:  # counted; the engine goes on as a real one would
                self.errors[f"engine: {exc!r}"[:120]] += 1
                acked = False
            with self._cond:  # computing the next prompt, or a retry interval; pause ends it
                self._cond.wait_for(lambda: self._stop or not self._want,
                                    PACE_S if acked else POLL_S)

    def _send(self, what: str) -> int:
        with self._cond:
            self.sent[what] += 1
            self._cond.notify_all()
            return self.sent[what]

    def _attempt(self, doc: int) -> bool:
        """One store of ``doc`` (its lookup first, once); True when acknowledged."""
        tokens = doc_tokens(self.seed, doc)
        if self._looked_up != doc:
            self._looked_up = doc
            seq = self._send("lookup")
            try:
                self.client.lookup(tokens, model_name=MODEL)
                self.outcome["lookup", seq] = True
            except DataPlaneError:  # the API is away: the engine computes without the cache
                self.outcome["lookup", seq] = False
                self.lookup_failures += 1
        full = len(tokens) // CHUNK * CHUNK
        self.kv.view(torch.int16)[:, :, :full] = doc_kv(self.seed, doc, full)
        seq = self._send("store")
        self.outcome["store", seq] = False
        try:
            transfer = self.client.store_pre_computed(self.instance, tokens, offset=0)
        except DataPlaneUnavailable:
            self.refused += 1
            return False
        try:
            res = transfer.wait(CALL_TIMEOUT)
        except DataPlaneUnavailable:
            self.cut_off += 1
            return False
        except DataPlaneError as exc:
            self.errors[f"store: {type(exc).__name__}: {exc}"[:120]] += 1
            return False
        if not res.ok or res.num_chunks != full // CHUNK or res.not_indexed:
            self.errors[f"store result: {res}"[:120]] += 1
            return False
        with self._cond:
            self.outcome["store", seq] = True
            self.acked.append(doc)
            self._cond.notify_all()
        return True


# -- results -----------------------------------------------------------------------------------


@dataclass
class Check:
    """What a check of some acknowledged documents found, in chunks."""

    chunks: int = 0
    lost: int = 0
    torn: int = 0
    unfindable: int = 0

    def add(self, other: "Check") -> None:
        self.chunks += other.chunks
        self.lost += other.lost
        self.torn += other.torn
        self.unfindable += other.unfindable


@dataclass
class Trial:
    """One kill and what followed.

    Attributes:
        delay_s: from the engine sending the call the kill aims at (a store; for the API, a
            lookup) to the kill.
        cut_off: that call failed (the kill cut it off); else it completed before the kill.
        ready_s: kill to ready; None when the restart failed.
        client_s: kill to the engine's next acknowledged store; None when none came.
        exit_s: supervisor trials: kill to the last of its children gone (None: not by the
            deadline).
        leftovers: processes of the prefix alive past the deadline (supervisor trials).
        left_as: each leftover's command line and signal state (``describe``), to tell why.
        acks_down: stores acknowledged between the kill and ready (the data path does not go
            through the API).
    """

    kind: str
    index: int
    delay_s: float
    cut_off: bool = False
    ready_s: float | None = None
    client_s: float | None = None
    exit_s: float | None = None
    leftovers: int = 0
    left_as: list[str] = field(default_factory=list)
    acks_down: int = 0
    check: Check = field(default_factory=Check)

    @property
    def failed(self) -> bool:
        return self.ready_s is None or self.client_s is None

    def line(self, total: int) -> str:
        def s(v: float | None) -> str:
            return "FAILED" if v is None else f"{v:.2f} s"
        extra = f", children gone {s(self.exit_s)}" if self.kind == "supervisor" else ""
        c = self.check
        call = "lookup" if self.kind == "api" else "store"
        return (f"[{self.kind} {self.index + 1}/{total}] kill {self.delay_s * 1000:.2f} ms after "
                f"a {call} was sent ({'cut off' if self.cut_off else 'it completed'}){extra}; "
                f"ready {s(self.ready_s)} ({self.acks_down} acks meanwhile), next ack "
                f"{s(self.client_s)}; checked {c.chunks} chunks:"
                f" lost {c.lost}, torn {c.torn}, unfindable {c.unfindable}"
                + (f", LEFTOVERS {self.leftovers}: {'; '.join(self.left_as)}"
                   if self.leftovers else ""))


@dataclass
class Report:
    """A whole run: its trials, the final check and stop, and the run's conditions."""

    seed: int
    plan: dict[str, int]
    trials: list[Trial] = field(default_factory=list)
    final: Check = field(default_factory=Check)
    acked_docs: int = 0
    acked_chunks: int = 0
    evictions: int = 0
    stop_rc: int | None = None
    leftover_processes: list[int] = field(default_factory=list)
    leftover_names: list[str] = field(default_factory=list)
    names_after_destroy: list[str] = field(default_factory=list)
    engine_errors: dict[str, int] = field(default_factory=dict)
    check_errors: dict[str, int] = field(default_factory=dict)
    log_errors: list[str] = field(default_factory=list)
    backoffs: list[str] = field(default_factory=list)
    load: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    aborted: str | None = None

    def of(self, kind: str) -> list[Trial]:
        return [t for t in self.trials if t.kind == kind]

    def problems(self, speed: bool = False) -> list[str]:
        """Every target missed (kill-to-ready only when ``speed``: never asserted in tests)."""
        out = [f"run aborted: {self.aborted}"] if self.aborted else []
        for kind in KINDS:
            ts = self.of(kind)
            for what in ("lost", "torn", "unfindable"):
                n = sum(getattr(t.check, what) for t in ts)
                if n:
                    out.append(f"{kind}: {n} chunks {what}")
            if failed := [t.index + 1 for t in ts if t.failed]:
                out.append(f"{kind}: failed restarts in trials {failed}")
            if left := sum(t.leftovers for t in ts):
                out.append(f"{kind}: {left} leftover processes")
            ready = [t.ready_s for t in ts if t.ready_s is not None]
            if speed and ready and statistics.median(ready) > READY_TARGET_S:
                out.append(f"{kind}: median kill-to-ready {statistics.median(ready):.2f} s "
                           f"> {READY_TARGET_S} s")
        for what in ("lost", "torn", "unfindable"):
            if n := getattr(self.final, what):
                out.append(f"final check: {n} chunks {what}")
        if self.evictions:
            out.append(f"the store evicted {self.evictions} chunks: lost counts are not "
                       "meaningful (size the store up)")
        if self.stop_rc != 0 and not self.aborted:
            out.append(f"kvblend serve exited with {self.stop_rc} after the final SIGTERM")
        for what in ("leftover_processes", "leftover_names", "names_after_destroy"):
            if getattr(self, what):
                out.append(f"{what.replace('_', ' ')}: {getattr(self, what)}")
        if self.engine_errors:
            out.append(f"engine errors: {self.engine_errors}")
        if self.check_errors:
            out.append(f"calls of the checks that failed: {self.check_errors}")
        if self.backoffs:
            out.append(f"restarts after a good start that backed off: {self.backoffs}")
        return out

    def table(self) -> str:
        head = (f"{'kind':<11}{'trials':>7}{'cut off':>8}{'acks down':>10}{'lost':>6}{'torn':>6}"
                f"{'unfind':>7}{'failed':>7}{'leftover':>9}   {'kill-to-ready p50 / max':<24}"
                f"{'kill-to-next-ack p50 / max':<27}children gone p50 / max")
        rows = [head, "-" * len(head)]
        rows += [self._row(kind) for kind in KINDS if self.of(kind)]
        rows += ["", f"run aborted: {self.aborted}"] if self.aborted else ["", *self._summary()]
        rows.append(f"seed {self.seed}; wall {self.wall_s:.0f} s; load average (1/5/15 min) "
                    + " -> ".join(self.load))
        return "\n".join(rows)

    def _row(self, kind: str) -> str:
        ts = self.of(kind)
        return (f"{kind:<11}{len(ts):>7}{sum(t.cut_off for t in ts):>8}"
                f"{sum(t.acks_down for t in ts):>10}"
                f"{sum(t.check.lost for t in ts):>6}{sum(t.check.torn for t in ts):>6}"
                f"{sum(t.check.unfindable for t in ts):>7}{sum(t.failed for t in ts):>7}"
                f"{sum(t.leftovers for t in ts):>9}   "
                f"{_spread([t.ready_s for t in ts]):<24}{_spread([t.client_s for t in ts]):<27}"
                + (_spread([t.exit_s for t in ts]) if kind == "supervisor" else "-"))

    def _summary(self) -> list[str]:
        f = self.final
        return [f"final check: {self.acked_docs} acknowledged documents, {self.acked_chunks} "
                f"chunks; lost {f.lost}, torn {f.torn}, unfindable {f.unfindable}; evictions "
                f"{self.evictions}",
                f"final stop: exit code {self.stop_rc}; leftover processes "
                f"{self.leftover_processes}; leftover names {self.leftover_names}; names after "
                f"destroy {self.names_after_destroy}",
                f"error lines in the service log: {len(self.log_errors)}; engine errors: "
                f"{self.engine_errors or 'none'}"]


def _spread(values: Sequence[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{statistics.median(got):.2f} / {max(got):.2f} s"


# -- the trials --------------------------------------------------------------------------------


class FaultTrials:
    """Runs the trials of ``plan`` (kind -> number of kills) against a service on ``prefix``.

    Args:
        prefix: a private shm prefix (the caller removes what is left under it).
        log: the service's stderr, appended across restarts.
        seed: every random choice.
        out: progress lines (one per trial), or None.
    """

    def __init__(self, prefix: str, log: Path, seed: int,
                 out: Callable[[str], None] | None = None) -> None:
        self.prefix, self.log, self.seed = prefix, log, seed
        self.kill_rng = random.Random(seed)             # the kill moments
        self.sample_rng = random.Random(seed + 1)       # earlier documents re-checked
        self.port = free_port()
        self.out = out or (lambda line: None)
        self.service: TrialService | None = None
        self.engine: Engine | None = None
        self.store: Store | None = None
        self._checked = 0  # documents [0, _checked) of engine.acked checked after a trial
        self.check_errors: collections.Counter[str] = collections.Counter()

    def run(self, plan: dict[str, int]) -> Report:
        """Start the service, run every trial in ``plan``'s order, check everything, stop."""
        report = Report(self.seed, dict(plan), load=[load_average()])
        t0 = time.monotonic()
        try:
            self._start()
            for kind, i in ((k, i) for k in KINDS for i in range(plan.get(k, 0))):
                trial = self._trial(kind, i)
                report.trials.append(trial)
                self.out(trial.line(plan[kind]))
                if trial.ready_s is None:  # nothing to go on with: report what was seen
                    report.aborted = f"{kind} trial {i + 1}: the service did not come back"
                    break
            else:
                self._finish(report)
        finally:
            report.check_errors = dict(self.check_errors)
            self._abandon()
        report.wall_s = time.monotonic() - t0
        report.load.append(load_average())
        return report

    # -- start and finish ---------------------------------------------------------------------

    def _start(self) -> None:
        self.service = svc = TrialService(self.prefix, self.port, self.log)
        if within(lambda: svc.exited or svc.ready(), START_DEADLINE) is None or svc.exited:
            raise TrialError(f"kvblend serve did not start: see {self.log}")
        self.store = Store.open(self.prefix)
        self.engine = Engine(svc.url, self.seed)

    def _finish(self, report: Report) -> None:
        """Check every acknowledged document, close the engine (its buffer goes), stop the
        service, and look for what it left."""
        svc, eng, store = self._parts()
        eng.pause()
        report.final = self._check(list(range(len(eng.acked))))
        report.acked_docs = len(eng.acked)
        report.acked_chunks = sum(len(doc_hashes(self.seed, d)) for d in eng.acked)
        report.evictions = store.stats().evictions
        report.engine_errors = dict(eng.errors)
        self.engine = None
        eng.close()
        self.store = None
        store.close()
        self.service = None
        report.stop_rc = svc.stop()
        self._leftovers(report)

    def _leftovers(self, report: Report) -> None:
        names = Names(self.prefix)
        kept = {os.path.basename(p) for p in names.service_paths()}
        kept.discard(os.path.basename(names.socket))  # a clean stop removes it
        report.leftover_processes = processes_of(self.prefix)
        report.leftover_names = [n for n in self._names() if n not in kept]
        destroy(self.prefix)
        report.names_after_destroy = self._names()
        text = self.log.read_text(errors="replace").splitlines()
        report.log_errors = [line for line in text if " ERROR " in line
                             or line.startswith("Traceback")]
        report.backoffs = [line for line in text
                           if "exited with code" in line and "restarting in 0.0 s" not in line]

    def _names(self) -> list[str]:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{self.prefix}_"))

    def _abandon(self) -> None:
        """After a failure: stop what is still running, kill what does not stop."""
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                pass
        if self.store is not None:
            self.store.close()
        if self.service is not None:
            self.service.stop()
        for pid in processes_of(self.prefix):
            _kill(pid)

    def _parts(self) -> tuple[TrialService, Engine, Store]:
        assert self.service and self.engine and self.store, "run() starts them first"
        return self.service, self.engine, self.store

    # -- one trial ----------------------------------------------------------------------------

    def _trial(self, kind: str, index: int) -> Trial:
        svc, eng, _ = self._parts()
        base = len(eng.acked)
        eng.resume()
        if not eng.wait_acks(base + 1, START_DEADLINE):  # the client works again
            raise TrialError(f"the engine got no store acknowledged before {kind} trial "
                             f"{index + 1}: {dict(eng.errors)}")
        trial = Trial(kind, index, self.kill_rng.uniform(0.0, KILL_WINDOW))
        pid, children = self._target(kind, svc), children_of(svc.proc.pid)
        aim = "lookup" if kind == "api" else "store"   # the call the kill falls into
        seq = eng.next_call(aim, START_DEADLINE)
        if seq is None:
            raise TrialError(f"the engine sent no {aim} before {kind} trial {index + 1}")
        time.sleep(trial.delay_s)  # the kill moment, drawn from the seed: not a wait for anything
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        acks = len(eng.acked)
        if kind == "supervisor":
            self._new_service(svc, children, t_kill, trial)
        else:
            self._restarted(svc, kind, pid, t_kill, trial)
        trial.acks_down = len(eng.acked) - acks
        if trial.ready_s is not None and eng.wait_acks(len(eng.acked) + 1, START_DEADLINE):
            trial.client_s = time.monotonic() - t_kill
        eng.pause()
        trial.cut_off = not eng.outcome.get((aim, seq), False)
        if trial.ready_s is not None:  # else the run ends here
            trial.check = self._check(self._to_check(full=kind == "supervisor"))
        return trial

    def _target(self, kind: str, svc: TrialService) -> int:
        """The pid a trial of ``kind`` kills."""
        if kind == "supervisor":
            return svc.proc.pid
        pid = within(svc.dataplane_pid if kind == "dataplane" else svc.api_pid, START_DEADLINE)
        if pid is None:
            raise TrialError(f"no {kind} process to kill")
        return pid

    def _restarted(self, svc: TrialService, kind: str, pid: int, t_kill: float, trial: Trial) -> None:
        """Until the supervisor's new data plane (or API) serves: ``trial.ready_s``."""
        def back() -> bool:
            if svc.exited:
                return True
            if not svc.ready():
                return False
            now = svc.dataplane_pid() if kind == "dataplane" else svc.api_pid()
            return now not in (None, pid)
        if within(back, START_DEADLINE) and not svc.exited:
            trial.ready_s = time.monotonic() - t_kill

    def _new_service(self, svc: TrialService, children: list[int], t_kill: float,
                     trial: Trial) -> None:
        """After the supervisor's SIGKILL: its children gone (``trial.exit_s``; those left are
        counted and killed), then a new ``kvblend serve`` on the prefix and port
        (``trial.ready_s``)."""
        svc.proc.wait()
        svc.http.close()
        if within(lambda: not any(pid_alive(p) for p in children), CHILD_EXIT_DEADLINE):
            trial.exit_s = time.monotonic() - t_kill
        left = processes_of(self.prefix)
        trial.leftovers, trial.left_as = len(left), [describe(p) for p in left]
        for pid in left:  # so that the new service can start
            _kill(pid)
        within(lambda: not any(pid_alive(p) for p in left), CHILD_EXIT_DEADLINE)
        self.service = new = TrialService(self.prefix, self.port, self.log)
        if within(lambda: new.exited or new.ready(), START_DEADLINE) and not new.exited:
            trial.ready_s = time.monotonic() - t_kill
            old, self.store = self.store, None
            assert old is not None, "run() opens the store first"
            old.close()  # check what the new service serves: a store it recreated is another
            self.store = Store.open(self.prefix)

    # -- checks -------------------------------------------------------------------------------

    def _to_check(self, full: bool) -> list[int]:
        """Indexes into ``engine.acked``: those acknowledged since the last check and a sample of
        earlier ones (all of them when ``full``)."""
        _, eng, _ = self._parts()
        new, old = list(range(self._checked, len(eng.acked))), range(self._checked)
        self._checked = len(eng.acked)
        if full:
            return list(old) + new
        return sorted(self.sample_rng.sample(old, min(SAMPLE_OLD, len(old)))) + new

    def _check(self, which: list[int]) -> Check:
        """Held, byte-exact and findable: every chunk of the acknowledged documents ``which``."""
        _, eng, store = self._parts()
        ns = Namespace(MODEL)
        out = Check()
        batch: list[tuple[int, list[bytes]]] = []
        room = (BUFFER_TOKENS - CHECK_AT) // CHUNK
        for doc in dict.fromkeys(eng.acked[i] for i in which):  # each document once
            hashes = doc_hashes(self.seed, doc)
            held = store.contains([ChunkKey(ns.id, h) for h in hashes])
            out.chunks += len(hashes)
            out.lost += int(np.count_nonzero(~held))
            if sum(len(h) for _, h in batch) + len(hashes) > room:
                out.add(self._check_bytes(batch))
                batch = []
            batch.append((doc, [h for h, ok in zip(hashes, held) if ok]))
        if batch:
            out.add(self._check_bytes(batch))
        return out

    def _check_bytes(self, batch: list[tuple[int, list[bytes]]]) -> Check:
        """One retrieve and one lookup of a prompt that is the documents' held chunks in a row;
        counts torn and unfindable chunks."""
        _, eng, _ = self._parts()
        parts, matches, expect = [], [], []
        at = 0
        for doc, held in batch:
            tokens = doc_tokens(self.seed, doc)
            kv = doc_kv(self.seed, doc, len(tokens) // CHUNK * CHUNK)
            for i, h in enumerate(doc_hashes(self.seed, doc)):
                if h in held:
                    parts.append(tokens[i * CHUNK:(i + 1) * CHUNK])
                    matches.append(Match(i * CHUNK, (i + 1) * CHUNK, at, at + CHUNK, h))
                    expect.append(kv[:, :, i * CHUNK:(i + 1) * CHUNK])
                    at += CHUNK
        if not matches:
            return Check()
        prompt = np.concatenate(parts)
        region = eng.kv.view(torch.int16)[:, :, CHECK_AT:CHECK_AT + at]
        region.fill_(-1)
        try:
            res = eng.client.retrieve(eng.instance, prompt, matches, offset=CHECK_AT).wait(
                CALL_TIMEOUT)
            failed = set(res.failed)
        except DataPlaneError as exc:  # nothing delivered: every chunk of the batch is torn
            self.check_errors[f"retrieve: {type(exc).__name__}: {exc}"[:120]] += 1
            failed = set(range(len(matches)))
        torn = sum(1 for j, want in enumerate(expect) if j in failed or not torch.equal(
            region[:, :, j * CHUNK:(j + 1) * CHUNK], want))
        try:
            found = {(m.cur_st, bytes(m.chunk_hash))
                     for m in eng.client.lookup(prompt, model_name=MODEL).matches}
        except DataPlaneError as exc:  # nothing found
            self.check_errors[f"lookup: {type(exc).__name__}: {exc}"[:120]] += 1
            found = set()
        unfindable = sum(1 for m in matches if (m.cur_st, m.chunk_hash) not in found)
        return Check(torn=torn, unfindable=unfindable)


__all__ = ["FaultTrials", "Report", "Trial", "Check", "KINDS", "READY_TARGET_S", "TrialError"]
