"""What tests and benchmarks share to drive real processes: a free port, a bounded poll, a
``kvblend serve`` subprocess, a unique shared-memory prefix, and the check that a memory-layout
drawing in a module's docstring is its declaration.

One of each, so that a deadline, a port or a clean stop is decided in one place:

    free_port()      a loopback port nobody listens on, outside the kernel's ephemeral range
    poll()           a check called until it is truthy; ``PollTimeout`` naming what past a deadline
    Service          one ``kvblend serve`` on a free port and a prefix; ``stop()`` is SIGTERM, a
                     bounded wait, then SIGKILL
    Services         what the ``services`` fixture (tests/conftest.py) hands a test:
                     ``services.start(...)`` on the test's own prefix; every service still running
                     is stopped afterwards, then the prefix removed (``shm_prefix``)
    drawn()          ``name -> word`` of a table drawn in a docstring, and the check that it is
                     an ``IntEnum``'s declaration

Benchmarks import this module too (they put the repository's root on ``sys.path``); it does not
import pytest.
"""

from __future__ import annotations

import glob
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvblend.dataplane.standby import peer_uid
from kvblend.shm.names import Names

T = TypeVar("T")
S = TypeVar("S", bound="Service")

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
#: generous: the suite shares two cores with other work; a healthy service is ready in seconds
START_DEADLINE = 120.0
STOP_DEADLINE = 90.0
POLL_S = 0.02
#: ports are drawn above this and outside the kernel's ephemeral range, so no outgoing connection
#: takes a port while the process that owns it is down between a stop and a restart
LOWEST_PORT = 15000
#: the service the tests start unless they say otherwise: CPU, a small store and index
SMALL_CPU = ("--backend", "cpu", "--storage-mb", "64", "--fingerprint-capacity", "65536",
             "--log-level", "warning")

_random = random.SystemRandom()


# -- ports and polls ----------------------------------------------------------------------------


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A loopback port nobody listens on now, outside the ephemeral range where that range
    allows, and not in ``exclude``."""
    ephemeral = _ephemeral_ports()
    pool = [p for p in range(LOWEST_PORT, 65536) if p not in ephemeral] or \
        list(range(LOWEST_PORT, 65536))
    for _ in range(200):
        port = _random.choice(pool)
        if port in exclude:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port on {HOST} after 200 tries")


class PollTimeout(TimeoutError):
    """A polled condition did not hold before its deadline."""


def poll(check: Callable[[], T], deadline_s: float, what: str, *, every_s: float = POLL_S) -> T:
    """``check()``'s first truthy value, called every ``every_s``; ``PollTimeout`` naming
    ``what`` once ``deadline_s`` passed. The deadline bounds a wait for another process's state;
    nothing depends on how soon within it the state comes."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise PollTimeout(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(every_s)  # a poll interval with a deadline, not a wait for an event


# -- shared-memory prefixes ---------------------------------------------------------------------


def unique_prefix(stem: str = "kvbt") -> str:
    """A shared-memory prefix no other test or run uses."""
    return f"{stem}_{uuid.uuid4().hex[:10]}"


def remove_prefix(prefix: str) -> None:
    """Unlink every name under ``prefix`` in /dev/shm, whoever owns it: segments, lock files,
    sockets, and the foreign names and symlinks tests plant (the prefix is the caller's own)."""
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# -- the service --------------------------------------------------------------------------------


def kvblend_argv() -> list[str]:
    """The ``kvblend`` command of this environment."""
    script = Path(sys.executable).with_name("kvblend")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvblend.api.cli"]


def serve_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child ``kvblend``: none of its ``KVBLEND_*`` settings
    (the child's are the caller's to give); numba's cache is this process's (``NUMBA_CACHE_DIR``
    when set, else the user's, as for any ``kvblend serve``: ``kvblend.shm._jit``). Warm spares
    are off (``KVBLEND_STANDBY=false``) unless ``extra`` turns them on: two more processes warming
    after each start would double the suite's CPU (tests/test_standby.py tests them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}
    return {**env, "KVBLEND_STANDBY": "false", **(extra or {})}


class ServiceExited(AssertionError):
    """``kvblend serve`` exited before it was ready."""


class Service:
    """One ``kvblend serve`` subprocess on ``prefix`` and a loopback port.

    Args:
        prefix: the shm prefix, the caller's own (the caller removes it: ``services`` does);
            empty: no ``--shm-prefix``, so the user's own (``kvblend.api.userprefix``).
        *flags: more ``serve`` flags, after ``defaults``: where both name a flag, these win.
        port: the port, to start again where a stopped service was; else a free one.
        defaults: the flags before ``flags`` (``()``: the settings come from ``env``).
        env: more environment variables (this process's ``KVBLEND_*`` are not passed on).
        token: the API token: in the environment (off the command line, as the README advises)
            and presented by ``http``.
        log: file that receives the service's stderr, appended (a restart writes on); else the
            service writes to this process's stderr.
        wait: return once ``/readyz`` answers 200 (``ServiceExited`` if it exits first); else at
            once (``ready()`` and ``wait_ready()`` tell).
        start_deadline_s: how long ``wait`` waits.
        http_timeout_s: the timeout of each call through ``http``.
    """

    def __init__(self, prefix: str, *flags: str, port: int | None = None,
                 defaults: Sequence[str] = SMALL_CPU, env: Mapping[str, str] | None = None,
                 token: str | None = None, log: Path | None = None, wait: bool = True,
                 start_deadline_s: float = START_DEADLINE, http_timeout_s: float = 10.0) -> None:
        self.prefix, self.token, self.log = prefix, token, log
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {**(env or {}), **({"KVBLEND_API_TOKEN": token} if token else {})}
        self.proc = self._spawn(
            [*kvblend_argv(), "serve", "--port", str(self.port),
             *(("--shm-prefix", prefix) if prefix else ()), *defaults, *flags], serve_env(env))
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, timeout=http_timeout_s, headers=headers)
        if wait:
            try:
                self.wait_ready(start_deadline_s)
            except BaseException:
                self.kill()
                raise

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        """Start the process; a subclass that reads its output starts it otherwise."""
        if self.log is None:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        with self.log.open("ab") as err:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None

    def ready(self) -> bool:
        """``/readyz`` answers 200 now."""
        try:
            return self.http.get("/readyz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, deadline_s: float = START_DEADLINE) -> None:
        """Until ``/readyz`` answers 200; ``ServiceExited`` (with the log's tail) if the service
        exits first, ``PollTimeout`` past ``deadline_s``."""
        def up() -> bool:
            if self.exited:
                raise ServiceExited(f"kvblend serve exited with code {self.proc.returncode}"
                                    + (f": {self.log_tail()}" if self.log else ""))
            return self.ready()
        poll(up, deadline_s, f"/readyz of kvblend serve on port {self.port}")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of ``log``."""
        assert self.log is not None, "a service without a log"
        return self.log.read_text(errors="replace")[-chars:]

    def status(self) -> dict[str, Any]:
        r = self.http.get("/v1/status")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metrics(self) -> dict[str, float]:
        """Every unlabelled sample of ``/metrics``, by name."""
        text = self.http.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not s.labels}

    def dataplane_pid(self) -> int | None:
        """The live data plane's pid, or None (none alive, or the API does not answer)."""
        try:
            r = self.http.get("/v1/status")
        except httpx.TransportError:
            return None
        dp = r.json()["dataplane"] if r.status_code == 200 else {}
        return int(dp["pid"]) if dp.get("alive") and dp.get("pid") else None

    def dataplane_after(self, old_pid: int, deadline_s: float = START_DEADLINE) -> dict[str, Any]:
        """Until a data plane other than ``old_pid`` is alive (the supervisor restarted it):
        its part of ``/v1/status``."""
        def back() -> dict[str, Any] | None:
            dp = dict(self.status()["dataplane"])
            return dp if dp["alive"] and dp["pid"] not in (None, old_pid) else None
        return poll(back, deadline_s, "the data plane's restart")

    def stop(self, deadline_s: float = STOP_DEADLINE) -> int:
        """SIGTERM, then the exit code; SIGKILL past ``deadline_s`` (then -9)."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        """SIGKILL, then the exit code: nothing is cleaned up on the way down."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


def listener_pid(port: int) -> int | None:
    """The process that holds the socket listening on TCP ``port`` (this uid's), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        inodes |= {f"socket:[{r[9]}]" for r in rows
                   if r[1].endswith(f":{port:04X}") and r[3] == "0A"}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                return pid
        except OSError:
            continue
    return None


def spare_pid(prefix: str, child: str) -> int | None:
    """The pid of the warm spare of ``child`` waiting under ``prefix``, or None. It asks the spare
    (its hello) and hangs up, which leaves the spare waiting."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10.0)
        try:
            conn.connect(Names(prefix).standby(child))
            pid, _uid = peer_uid(conn)
            conn.recv(256)  # its hello: it is past accept
        except OSError:
            return None
    return pid


class Services:
    """The services a test started on its prefix (the ``services`` fixture of tests/conftest.py
    stops every one still running afterwards)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.started: list[Service] = []

    def start(self, *flags: str, **options: Any) -> Service:
        """A ``Service`` on the test's prefix (``Service`` says what ``flags`` and ``options``
        are)."""
        return self.add(Service(self.prefix, *flags, **options))

    def add(self, svc: S) -> S:
        """``svc`` (a subclass's, started by the test) is stopped afterwards too."""
        self.started.append(svc)
        return svc

    def stop_all(self) -> None:
        for svc in self.started:
            svc.stop()


# -- drawings -----------------------------------------------------------------------------------


def drawn(doc: str | ModuleType, title: str) -> dict[str, int]:
    """``name -> word`` from the table that follows ``title`` in a docstring (a module's, or the
    text itself): its first block after ``::``, one row per word, the word's index first."""
    text = doc if isinstance(doc, str) else doc.__doc__ or ""
    table = text[text.index(title):].split("::", 1)[1].split("\n\n")[1]
    rows = [re.match(r"\s+(\d+)\s+([A-Z_0-9]+)\s", line) for line in table.splitlines()]
    return {m.group(2): int(m.group(1)) for m in rows if m}


def declared(words: type[IntEnum]) -> dict[str, int]:
    """``name -> word`` of a declaration."""
    return {w.name: int(w) for w in words}


def assert_drawing_is_declaration(doc: str | ModuleType, title: str,
                                  words: type[IntEnum]) -> None:
    """The table under ``title`` draws exactly ``words``, each at its index, and the words fill
    0..n-1: no gap, no two at one position."""
    assert drawn(doc, title) == declared(words)
    assert sorted(int(w) for w in words) == list(range(len(words)))  # no gap, no overlap
