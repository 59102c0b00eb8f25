"""The data-plane server: accepts channel connections, dispatches calls, shuts down cleanly.

This module owns the process's threads::

    accept thread        one per process: accepts connections on the Unix socket, closes those
                         of another uid (``SO_PEERCRED``) or past ``max_connections``
    connection threads   one per client connection: read frames, answer control calls inline
                         (Ping, ListInstances, RegisterInstance, RenewLease), queue transfers on
                         their instance once its token checked out, pass LayersWritten frames
                         to their layer-wise store (``dataplane.transfer.Gate``)
    instance workers     one per instance: StoreChunks / RetrieveChunks / UnregisterInstance
                         started in arrival order (``dataplane.instance``)
    completion threads   one per instance: the end of its calls (wait for the copies, commit or
                         unpin, reply) while its worker starts the next
    maintenance          periodic ``store.renew_pins()`` (its own pins are a lease), ``reclaim()``,
                         a sweep for orphaned chunks (``shm.orphans``), and dropping instances
                         whose lease ran out
                         (then removing their engine's shm segments once ``shm.kvbufs`` proves
                         the owner gone)

Control calls never queue behind a copy: they are answered on the connection's own thread.
A client that disconnects mid-call changes nothing: its queued calls still run to their end
(committing or aborting every reservation, dropping every pin); only the reply is discarded.

NOTE: on ``shutdown()`` (SIGTERM) the listener closes and connections stop reading; every call
already queued runs to completion before the workers exit.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from kvblend.dataplane.backend import CopyEngine
from kvblend.dataplane.channel import recv_frame
from kvblend.dataplane.errors import BackendError, BadRequest, RemoteError, remote_error, reply_for
from kvblend.dataplane.instance import Instance
from kvblend.dataplane.instances import Limits, Registry
from kvblend.dataplane.messages import (ErrorKind, ErrorReply, InstanceList, LayersReady,
                                        LayersWritten, LeaseRenewed, ListInstances, Ping, Pong,
                                        Prefetching, PrefetchChunks, Registered, RegisterInstance,
                                        RenewLease, RetrieveChunks, StoreChunks, Unregistered,
                                        UnregisterInstance, frame, request_decoder)
from kvblend.dataplane.transfer import Call, Gate, Shared, prefetch, retrieve_call, store_call
from kvblend.shm.events import EventLog
from kvblend.shm.kvbufs import remove_orphan
from kvblend.shm.orphans import OrphanSweeper
from kvblend.shm.private import check_socket
from kvblend.shm.telemetry import Counter, RetrieveError, StoreError
from kvblend.shm.version import kvblend_version

log = logging.getLogger("kvblend.dataplane")


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_conn_ids = itertools.count(1)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(raw)[1])


class Connection:
    """One client connection; replies may be sent from any thread.

    Attributes:
        id: names the connection in the per-client instance limit.
        uid: the peer's uid, read once at accept.
    """

    def __init__(self, sock: socket.socket, uid: int, events: EventLog) -> None:
        self.sock, self.uid, self._events = sock, uid, events
        self.id = next(_conn_ids)
        self._send_lock = threading.Lock()

    def reply(self, call_id: int, msg: Any) -> None:
        """Send a reply (an ``ErrorReply`` counts as a data-plane error)."""
        if isinstance(msg, ErrorReply):
            self._events.add(Counter.DATAPLANE_ERRORS)
        data = frame(call_id, msg)
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError:
            pass  # the client went away; the call itself has completed


class DataPlane:
    """Serves the channel for one store prefix.

    Args:
        prefix: the store's segment prefix.
        shared: store, fingerprint index, event log, chunk size.
        engine: the copy engine (CPU or CUDA).
        reclaim_interval: seconds between maintenance passes.
        limits: instance lease and bounds.
        max_connections: client connections at once; more are closed at accept.
    """

    def __init__(self, prefix: str, shared: Shared, engine: CopyEngine,
                 reclaim_interval: float = 1.0, limits: Limits | None = None,
                 max_connections: int = 256) -> None:
        self.prefix, self.shared, self.engine = prefix, shared, engine
        self.registry = Registry(prefix, shared.store, engine, shared.chunk_size, limits)
        self._interval = reclaim_interval
        self._orphans = OrphanSweeper(shared.store, shared.fingerprints)
        self._max_connections = max_connections
        self._uid = os.geteuid()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._gates: dict[tuple[int, int], Gate] = {}  # layer-wise stores by (connection, call)
        self._gates_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- life cycle -------------------------------------------------------------------------

    def start(self, address: str) -> None:
        """Re-open saved instances, bind ``address``, and start serving in background threads.

        Raises:
            OSError: another data plane answers at ``address``.
        """
        restored = self.registry.restore()
        if restored:
            log.info("re-opened instances %s", restored)
        self._listener = _bind(address)
        self.address = address
        for target, name in ((self._accept, "accept"), (self._maintain, "maintenance")):
            t = threading.Thread(target=target, name=f"dataplane-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking calls, finish every queued call, release buffers."""
        self._stop.set()
        if self._listener is not None:
            _unlink_socket(self._listener, self.address)
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        instances = self.registry.all()
        for inst in instances:
            inst.submit(_stop_worker, bounded=False)
        for inst in instances:
            if inst.thread is not None:
                inst.thread.join(timeout)
            inst.buffer.close()
        for c in conns:
            c.sock.close()
        self.engine.close()

    # -- threads ----------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None, "start() binds the listener before this thread runs"
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = self._admit(sock)
            if conn is None:
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dataplane-conn",
                             daemon=True).start()

    def _admit(self, sock: socket.socket) -> Connection | None:
        """A ``Connection`` for a peer of our uid while there is room; else close the socket."""
        try:
            uid = peer_uid(sock)
        except OSError:
            sock.close()
            return None
        with self._conns_lock:
            full = len(self._conns) >= self._max_connections
            if uid == self._uid and not full:
                conn = Connection(sock, uid, self.shared.events)
                self._conns.add(conn)
                return conn
        log.warning("refused a connection from uid %d (%s)", uid,
                    "connection limit reached" if full and uid == self._uid
                    else f"only uid {self._uid} may connect")
        sock.close()
        return None

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                got = recv_frame(conn.sock)
                if got is None:
                    return
                call_id, payload = got
                try:
                    msg = request_decoder.decode(payload)
                except Exception as exc:
                    conn.reply(call_id, ErrorReply(kind=ErrorKind.BAD_REQUEST,
                                                   message=f"undecodable message: {exc}"))
                    continue
                self._dispatch(conn, call_id, msg)
        except OSError:  # includes a frame over the limit: the stream cannot be resynchronized
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.sock.close()  # replies of calls still queued are dropped (Connection.reply)

    def _maintain(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.shared.store.renew_pins()
                freed, dropped = self.shared.store.reclaim()
                if freed or dropped:
                    log.info("reclaimed %d reservations and %d pins (dead processes, pin leases "
                             "run out)", freed, dropped)
                for inst in self.registry.expired():
                    # its worker may wait for an engine that is gone (an order word never
                    # written): the drop, or an unregistration sent before, queues behind it
                    inst.buffer.release()
                    if self.registry.claim_drop(inst):
                        log.info("the lease of instance %d ran out: dropping it", inst.id)
                        self.shared.events.add(Counter.INSTANCES_EXPIRED)
                        inst.submit(_drop_job(self.registry), bounded=False)
                if self._orphans.due(time.monotonic()):
                    swept = self._orphans.run(time.monotonic())
                    if swept.orphans:
                        log.info("%s", swept)
            except Exception:
                log.exception("maintenance pass failed")

    # -- calls ------------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, call_id: int, msg: Any) -> None:
        if isinstance(msg, LayersWritten):
            self._announce(conn, msg)  # no reply
            return
        try:
            if isinstance(msg, (StoreChunks, RetrieveChunks, UnregisterInstance)):
                inst = self.registry.authorize(msg.instance_id, msg.token)
                if isinstance(msg, UnregisterInstance):
                    if not self.registry.claim_drop(inst):
                        raise BadRequest(f"instance {inst.id} is being unregistered already")
                    inst.submit(_transfer_job(self, conn, call_id, msg), bounded=False)
                    return
                gate = None
                if isinstance(msg, StoreChunks) and msg.layer_groups:
                    # before it is queued: its announcements follow on this thread
                    gate = Gate(inst.id)
                    with self._gates_lock:
                        self._gates[(conn.id, call_id)] = gate
                try:
                    inst.submit(_transfer_job(self, conn, call_id, msg, gate))
                except BaseException:
                    self.forget_gate(conn, call_id)
                    raise
                return
            conn.reply(call_id, self._control(conn, msg))
        except Exception as exc:
            err = remote_error(exc)
            if isinstance(err, BackendError) and not isinstance(exc, RemoteError):
                log.exception("call %s failed (request_id=%s)", type(msg).__name__,
                              getattr(msg, "request_id", None))
            conn.reply(call_id, reply_for(err))

    def _announce(self, conn: Connection, msg: LayersWritten) -> None:
        """Pass a ``LayersWritten`` to its store; one that names no layer-wise store of this
        instance in flight on this connection, or carries a wrong token, is dropped."""
        try:
            self.registry.authorize(msg.instance_id, msg.token)
        except RemoteError as exc:
            log.warning("dropped a LayersWritten frame: %s", exc)
            return
        with self._gates_lock:
            gate = self._gates.get((conn.id, msg.call))
        if gate is not None and gate.instance_id == msg.instance_id:
            gate.announce(msg.layers)

    def forget_gate(self, conn: Connection, call_id: int) -> None:
        with self._gates_lock:
            self._gates.pop((conn.id, call_id), None)

    def _control(self, conn: Connection, msg: Any) -> Any:
        if isinstance(msg, Ping):
            return Pong(pid=os.getpid(), backend=self.engine.backend, version=kvblend_version(),
                        chunk_size=self.shared.chunk_size, shm_prefix=self.prefix)
        if isinstance(msg, ListInstances):
            return InstanceList(instances=[i.info() for i in self.registry.all()])
        if isinstance(msg, RegisterInstance):
            inst = self.registry.register(msg.registration, conn.uid, conn.id,
                                          request_id=msg.request_id, caller=msg.caller)
            return Registered(instance_id=inst.id, token=inst.token,
                              lease_s=self.registry.limits.lease_s)
        if isinstance(msg, PrefetchChunks):  # answered at once: the fetches run on their own
            inst = self.registry.authorize(msg.instance_id, msg.token)
            return Prefetching(instance_id=inst.id, started=prefetch(self.shared, inst, msg))
        if isinstance(msg, RenewLease):
            inst = self.registry.authorize(msg.instance_id, msg.token)
            self.shared.events.add(Counter.LEASE_RENEWALS)
            return LeaseRenewed(instance_id=inst.id, lease_s=self.registry.limits.lease_s)
        raise BadRequest(f"unsupported call {type(msg).__name__}")

    def transfer_call(self, inst: Instance, msg: StoreChunks | RetrieveChunks,
                      progress: Callable[[LayersReady], None] | None = None,
                      gate: Gate | None = None) -> Call:
        """The call that runs ``msg`` on ``inst`` (``dataplane.transfer.Call``); its progress
        frames go through ``progress``; a layer-wise store hears its layers through ``gate``."""
        if isinstance(msg, StoreChunks):
            return store_call(self.shared, inst, msg, progress, gate)
        return retrieve_call(self.shared, inst, msg, progress)

    def failed(self, inst: Instance, msg: StoreChunks | RetrieveChunks,
               exc: BaseException) -> RemoteError:
        """Count and record a failed store or retrieve; the error to answer."""
        store = isinstance(msg, StoreChunks)
        self.shared.events.add(Counter.STORE_FAILURES if store else Counter.RETRIEVE_FAILURES)
        kind = StoreError if store else RetrieveError
        self.shared.events.record(kind(request_id=msg.request_id, instance_id=inst.id,
                                       error=repr(exc)[:200]))
        err = remote_error(exc)
        if isinstance(err, BackendError) and not isinstance(exc, RemoteError):
            log.exception("%s on instance %d failed (request_id=%s)", type(msg).__name__,
                          inst.id, msg.request_id, exc_info=exc)
        else:
            log.warning("%s on instance %d failed (request_id=%s): %s", type(msg).__name__,
                        inst.id, msg.request_id, err)
        return err


def _transfer_job(dp: DataPlane, conn: Connection, call_id: int, msg: Any,
                  gate: Gate | None = None) -> Any:
    def job(inst: Instance) -> bool:
        if isinstance(msg, UnregisterInstance):
            dp.registry.remove(inst)  # after every call in flight ended
            conn.reply(call_id, Unregistered(instance_id=inst.id))
            return False

        def done(reply: Any, error: BaseException | None) -> None:
            if gate is not None:
                dp.forget_gate(conn, call_id)
            conn.reply(call_id, reply if error is None else reply_for(dp.failed(inst, msg, error)))

        inst.run_call(dp.transfer_call(inst, msg, lambda p: conn.reply(call_id, p), gate), done,
                      store=isinstance(msg, StoreChunks))
        return True
    return job


def _drop_job(registry: Registry) -> Any:
    """The job that drops an instance whose lease ran out, then removes its engine's shm
    segments that are orphans."""
    def job(inst: Instance) -> bool:
        registry.remove(inst)
        _remove_orphans(registry, inst)
        return False
    return job


def _remove_orphans(registry: Registry, inst: Instance) -> None:
    """Unlink the engine buffers of ``inst`` (dropped: its lease ran out) that ``shm.kvbufs``
    proves orphans: the file opened at registration, its client's lock free, mapped by no process
    but this one. A segment that another instance still holds is left alone."""
    held = {ident for other in registry.all() for _, ident in other.buffer.segments}
    for name, ident in inst.buffer.segments:
        try:
            gone = ident not in held and remove_orphan(name, ident, exclude=os.getpid())
        except OSError as exc:
            log.warning("could not check engine buffer %s of instance %d: %s", name, inst.id, exc)
            continue
        if gone:
            log.info("removed engine buffer %s of instance %d: its owner is gone", name, inst.id)


def _stop_worker(inst: Instance) -> bool:
    return False


def _bind(address: str) -> socket.socket:
    """Listen on ``address`` (mode 0600), replacing a stale socket of ours.

    Raises:
        ForeignObject: something not ours holds the path (a file, a symlink, another user's
            socket); it is left in place.
        OSError: a live data plane already serves the path.
    """
    if check_socket(address):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(address)
        except OSError:
            os.unlink(address)  # left by a data plane that died
        else:
            raise OSError(f"a data plane already serves {address}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def _unlink_socket(listener: socket.socket, address: str) -> None:
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()
    try:
        os.unlink(address)
    except FileNotFoundError:
        pass


__all__ = ["DataPlane", "Connection"]
