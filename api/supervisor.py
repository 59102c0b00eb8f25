"""``kvblend serve``: create the shared state, run the data plane and the API, keep them running.

This module owns the service's process tree and start-up; it never serves a request itself::

    kvblend serve (this process)
    ├── python -m kvblend.dataplane              restarted when it dies; re-attaches
    ├── python -m kvblend.api.uvicorn_workers   uvicorn, --workers N; restarted when it dies
    └── a warm spare of each (``--standby``)     promoted when its child dies; outlives us

Restarts (``api.child``): a child that crashes after a good start (the data plane printed its
ready line, the API answered ``/healthz``) is restarted at once; one that keeps failing before it
is ready backs off (0.5 s doubling to 15 s); one that fails before it was ever ready ends
``serve`` with exit code 1 and one line naming the cause (a configuration problem does not go
away by restarting). Known configuration problems are checked before any child starts: a port
in use, /dev/shm too small for a new store.

Start-up: without ``--shm-prefix``, settle on the user's own prefix (``api.userprefix``: drawn
once, kept in the user's state folder, drawn again when a name under it is not ours); take the
prefix's serve lock (one supervisor per prefix), create or attach the store
(a geometry change recreates it empty, with a log line saying so; ``--wipe`` always starts
empty), the fingerprint index and the event log, then start both children. Pre-faulting a new slab
shows progress on stderr.

Every name of the prefix must be ours (``shm.private``): a lock file, segment or socket that
another user planted, or one with group/other bits, or a symlink, raises ``ForeignObject`` out of
``run`` before any child starts; ``kvblend serve`` then exits 2 with one line naming it, and the
name stays as it was.

Each child's environment holds its own settings and secrets only (``dataplane_env``, ``api_env``):
the data plane gets its whole ``DataPlaneSettings`` (``Settings.dataplane_settings``) as one
variable, ``KVBLEND_DP_SETTINGS``, and no other ``KVBLEND_*`` one (no API or admin token); the API
workers get the service's settings as ``KVBLEND_*`` variables (``Settings.to_env``) but no remote
credential. Neither gets a setting on its command line.

Logs: every process writes records in the service's one format (``dataplane.logs``,
``--log-format text|json``) to stderr; the supervisor relays its children's lines and wraps any
other output of theirs into a record (``api.child``), logs each child's start, readiness, exit and
stop (a stop by our SIGTERM is logged as clean), and names the pid and port of the serve that
holds the prefix when it cannot take it.

Children run in their own process group (a terminal's Ctrl+C reaches only the supervisor, which
then stops them in order) and get SIGTERM if the supervisor dies (``PR_SET_PDEATHSIG``).

Warm spares (``api.child``, ``api.spares``, ``dataplane.standby``; docs/faults.md): once both
children are ready, each gets a spare, imported and warmed, that a restart promotes instead of
starting a process from nothing. Spares outlive a killed supervisor, and the next ``kvblend
serve`` of the same configuration adopts them as its children's replacements at its start.

Shutdown on SIGTERM or SIGINT: the API first (uvicorn finishes in-flight requests), then the data
plane (it finishes queued copies), each with SIGKILL after its grace period. The cache stays in
shared memory for the next ``kvblend serve``.
"""

from __future__ import annotations

import errno
import fcntl
import http.client
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping

from kvblend.api.child import Child, StartupFailed
from kvblend.api.settings import Settings, prefix_file
from kvblend.api.userprefix import resolve as resolve_prefix
from kvblend.dataplane.backends import Backend, resolve
from kvblend.dataplane.settings import DataPlaneSettings
from kvblend.dataplane.wakeup import Wakeup
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.names import Names
from kvblend.shm.remotes import RemoteChunks
from kvblend.shm.private import check_socket, open_private
from kvblend.shm.store import Store, StoreConfig
from kvblend.shm.telemetry import Counter

log = logging.getLogger("kvblend.serve")

STARTING_POLL = 0.05     # seconds between readiness probes while a child starts


class AlreadyServing(RuntimeError):
    """Another ``kvblend serve`` (or ``destroy``) holds this prefix; the message names its
    pid, and its port when it serves one."""


def hold_prefix(prefix: str, command: str = "serve", port: int | None = None) -> int:
    """Take the lock a running ``kvblend serve`` holds on its prefix; returns its descriptor
    (closing it lets go). The lock file then says who holds it (``command``, this pid, ``port``),
    for the message of the next one that tries.

    Raises:
        AlreadyServing: a ``kvblend serve`` or ``destroy`` holds it.
    """
    fd = open_private(Names(prefix).lock("serve"), create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(os.pread(fd, 256, 0))
        os.close(fd)
        raise AlreadyServing(f"another kvblend {holder.get('command', 'serve')} runs on prefix "
                             f"{prefix!r}{_where(holder)}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"command={command} pid={os.getpid()} port={port or ''}\n".encode(), 0)
    return fd


def _holder(text: bytes) -> dict[str, str]:
    """What a lock file says of its holder: ``command``, ``pid``, ``port`` (any may be missing)."""
    pairs = (item.split("=", 1) for item in text.decode(errors="replace").split())
    return {k: v for k, v in (p for p in pairs if len(p) == 2) if v}


def _where(holder: dict[str, str]) -> str:
    """`` (pid N, API on port P)``, as much of it as the holder said and is still true."""
    pid = holder.get("pid", "")
    if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
        return ""  # written by a holder that died since (the lock went with it)
    port = holder.get("port", "")
    return f" (pid {pid}{', API on port ' + port if port.isdigit() else ''})"


class ConfigError(RuntimeError):
    """A setting the host cannot satisfy (a port in use, /dev/shm too small); one line says
    which and how to fix it."""


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will, then let it go.

    Raises:
        ConfigError: the port is taken (or the address is not this host's).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            fix = ("stop what holds it, or pass another --port" if exc.errno == errno.EADDRINUSE
                   else "check --host")
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; {fix}") from None


def probe_host(host: str) -> str:
    """Where the supervisor reaches the API it started (a wildcard bind answers on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def healthz(host: str, port: int, timeout: float = 0.25) -> bool:
    """True when the API at ``host:port`` answers ``/healthz`` with 200."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class ProgressLine:
    """Reports pre-faulting progress on stderr at most every few percent."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._last = -1.0
        self._t0 = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        if pct - self._last < 5 and done < total:
            return
        self._last = pct
        rate = done / max(time.monotonic() - self._t0, 1e-9) / (1 << 30)
        log.info("%s: %d / %d MiB (%.0f %%, %.2f GiB/s)", self.what, done >> 20, total >> 20,
                 pct, rate)


def store_config(settings: Settings) -> StoreConfig:
    return StoreConfig(capacity_bytes=settings.storage_mb << 20, page_bytes=settings.page_bytes,
                       min_slot_bytes=settings.min_slot_kb << 10)


def prepare(settings: Settings) -> None:
    """Create or attach the store, the fingerprint index and (with ``--remote``) the table of
    remote-known chunks of ``settings.shm_prefix``.

    A store of another geometry (``--storage-mb`` or page size changed) is recreated empty; so is
    a fingerprint index of another chunk size or capacity. Both are logged.

    Raises:
        ForeignObject: a name of the prefix, or the data plane's socket path, is not ours.
    """
    check_dataplane_socket(settings)
    prefix, cfg = settings.shm_prefix, store_config(settings)
    progress = ProgressLine(f"pre-faulting {settings.storage_mb} MiB of shared memory")
    wiped = settings.wipe
    try:
        store = Store.open(prefix, cfg, wipe=settings.wipe, progress=progress)
    except LayoutMismatch as exc:
        log.warning("recreating the store empty: %s", exc)
        store = Store.open(prefix, cfg, recreate_on_mismatch=True, progress=progress)
        wiped = True
    stats = store.stats()
    log.info("store %r: %d MiB in %d pages of %d MiB, %d chunks cached", prefix,
             stats.capacity_bytes >> 20, stats.num_pages, cfg.page_bytes >> 20, stats.num_objects)
    store.close()
    try:
        fps = FingerprintIndex.open(prefix, settings.chunk_size, settings.fingerprint_capacity,
                                    wipe=wiped)
    except LayoutMismatch as exc:
        log.warning("recreating the fingerprint index empty: %s", exc)
        fps = FingerprintIndex.open(prefix, settings.chunk_size, settings.fingerprint_capacity,
                                    wipe=True)
    log.info("fingerprint index: %d of %d entries", len(fps), fps.capacity)
    fps.close()
    if settings.remote is not None:
        try:
            remotes = RemoteChunks.open(prefix, settings.remote_capacity, wipe=wiped)
        except LayoutMismatch as exc:
            log.warning("recreating the table of remote chunks empty: %s", exc)
            remotes = RemoteChunks.open(prefix, settings.remote_capacity, wipe=True)
        remotes.close()


def check_dataplane_socket(settings: Settings) -> None:
    """Refuse to start when something not ours holds the data plane's socket path; the data plane
    would refuse it too, but only after the supervisor started it (and again at every restart).

    Raises:
        ForeignObject: the path exists and is not a socket of ours.
    """
    address = settings.dataplane_address()
    if os.path.isabs(address):
        check_socket(address)


def dataplane_env(parent: Mapping[str, str], settings: DataPlaneSettings) -> dict[str, str]:
    """The data plane's environment: the parent's, less every ``KVBLEND_*`` variable, plus its
    settings as ``KVBLEND_DP_SETTINGS`` (the remote tier's credentials inside them); the API
    token and the admin token never reach it."""
    env = {k: v for k, v in parent.items() if not k.startswith("KVBLEND_")}
    env.update(settings.to_env())
    return env


def api_env(parent: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """The API workers' environment: the parent's, less every ``KVBLEND_*`` variable, plus the
    service's settings (``Settings.to_env``, which uvicorn's workers read back: no remote
    credential) but ``wipe`` (children attach; only the supervisor may wipe)."""
    env = {k: v for k, v in parent.items() if not k.startswith("KVBLEND_")}
    env.update(settings.to_env())
    env.pop("KVBLEND_WIPE", None)
    return env


class Supervisor:
    """Runs the service for ``settings`` until SIGTERM/SIGINT; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        """Raises:
            ConfigError: no ``--shm-prefix``, and the user's own cannot be kept.
            ForeignObject: see ``api.userprefix.own_prefix``.
        """
        try:
            settings = resolve_prefix(settings)
        except OSError as exc:
            raise ConfigError(f"cannot keep the default prefix in {prefix_file()}: "
                              f"{exc.strerror or exc}; set XDG_STATE_HOME or pass --shm-prefix"
                              ) from None
        self.settings = settings
        self.backend: Backend = resolve(settings.backend)
        self._wake = Wakeup()  # the loop's: children, SIGCHLD and stop signals set it
        self._lock_fd = -1
        self._events: EventLog | None = None
        resolved = settings.model_copy(update={"backend": self.backend})
        self.dataplane = Child("dataplane", [sys.executable, "-m", "kvblend.dataplane"],
                               dataplane_env(os.environ, resolved.dataplane_settings()),
                               settings.stop_grace_s, Counter.DATAPLANE_RESTARTS,
                               ready_line=b"dataplane ready", wake=self._wake,
                               log_format=settings.log_format,
                               spare_path=self._spare_path("dataplane"))
        where = (probe_host(settings.host), settings.port)
        self.api = Child("api", [sys.executable, "-m", "kvblend.api.uvicorn_workers"],
                         api_env(os.environ, resolved), settings.api_grace_s,
                         Counter.API_RESTARTS, probe=lambda: healthz(*where), wake=self._wake,
                         log_format=settings.log_format, spare_path=self._spare_path("api"))

    def _spare_path(self, child: str) -> str | None:
        return Names(self.settings.shm_prefix).standby(child) if self.settings.standby else None

    # -- running ----------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything and supervise until a stop signal; returns the exit code."""
        self._take_prefix()
        self._wake.catch(wake=(signal.SIGCHLD,))  # handlers that take no lock
        try:
            check_port(self.settings.host, self.settings.port)
            try:
                prepare(self.settings)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise ConfigError(
                    f"/dev/shm cannot hold the cache ({self.settings.storage_mb} MiB plus the "
                    "fingerprint index): lower --storage-mb or --fingerprint-capacity, or grow "
                    "/dev/shm (mount -o remount,size=...; Docker: --shm-size)") from None
            if self._stopping:
                return 0
            self._events = EventLog.open(self.settings.shm_prefix)
            log.info("backend %s; API on http://%s:%d (%d worker%s)%s", self.backend,
                     self.settings.host, self.settings.port, self.settings.workers,
                     "s" if self.settings.workers > 1 else "",
                     "; API token required" if self.settings.api_token else "")
            self._supervise()
        except StartupFailed as exc:
            log.error("%s", exc)
            return 1
        finally:
            self.api.stop()
            self.dataplane.stop()
            if self._events is not None:
                self._events.close()
            os.close(self._lock_fd)
            self._wake.close()
        log.info("stopped; the cache stays in shared memory under prefix %r",
                 self.settings.shm_prefix)
        return 0

    @property
    def _stopping(self) -> bool:
        return self._wake.stop_signal is not None

    def _take_prefix(self) -> None:
        self._lock_fd = hold_prefix(self.settings.shm_prefix, "serve", self.settings.port)

    def _supervise(self) -> None:
        """Start, probe and restart the children until a stop signal.

        Raises:
            StartupFailed: a child exited before it was ever ready.
        """
        children = (self.dataplane, self.api)
        while not self._stopping:
            now = time.monotonic()
            for child in children:
                rc = child.reap(now)
                if rc is not None and not self._stopping:
                    log.warning("%s exited with %s: restarting in %.1f s", child.name,
                                child.exit_text(rc), child.next_start - now)
                if child.proc is None and now >= child.next_start and not self._stopping:
                    if child.starts:
                        assert self._events is not None, "the event log opens before children"
                        self._events.add(child.counter)
                    child.start()
                child.poll_ready()
            if all(c.ready.is_set() for c in children):  # spares only once nothing starts
                for child in children:
                    child.start_spare()
            starting = any(c.proc is not None and not c.ready.is_set() for c in children)
            pending = [c.next_start - now for c in children if c.proc is None]
            self._wake.wait(min([STARTING_POLL if starting else 1.0, *pending]))
        log.info("%s: shutting down", signal.Signals(self._wake.stop_signal).name)
