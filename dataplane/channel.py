"""The local channel: a Unix stream socket carrying framed, typed messages (``dataplane.messages``).

This module owns the client side (``Channel``) and the framing helpers both sides use. It does not
own what the data plane does with a call.

A ``Channel`` is thread-safe and multiplexed: every call gets a call id, a reader thread hands each
reply to the caller waiting for that id, so a long copy never holds up a ping or a call of another
instance sent on the same channel. Timeouts follow posix_ipc: ``None`` waits forever, ``0`` fails at
once unless the reply is already there, ``> 0`` waits that long. A call that timed out is not
cancelled: the data plane still completes it (a store still commits), its late reply is dropped.

A connect that fails says why (``unreachable``): no data plane listening at the address, or a
socket that refuses this process's uid (the uid rule of docs/security.md).

NOTE: the connection is opened lazily and re-opened by the next call after it broke (for example,
the data plane was restarted); calls in flight when it broke fail with ``DataPlaneUnavailable``.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import threading
from typing import Any

from kvblend.dataplane.errors import DataPlaneUnavailable, Timeout, error_for
from kvblend.dataplane.messages import (HEADER, MAX_FRAME, ErrorReply, LayersReady, Reply, frame,
                                        reply_decoder)


def recv_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """(call id, payload) of the next frame; None at a clean end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    length, call_id = HEADER.unpack(head)
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes exceeds the limit")
    payload = _recv_exact(sock, length)
    if payload is None:
        raise ConnectionError("connection closed inside a frame")
    return call_id, payload


FIRST_PIECE = 64 << 10  # a frame's buffer before any of its bytes came; it doubles as they come


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, into a buffer that grows with the bytes received (doubling, never past
    ``n``): a header that announces ``MAX_FRAME`` and sends a few bytes holds a few pages, not
    the length it announced (docs/security.md)."""
    if n == 0:
        return b""
    buf = bytearray(min(n, FIRST_PIECE))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(len(buf), n - got)))
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("connection closed inside a frame")
        got += k
    return bytes(buf)


class Pending:
    """The reply to one call, once it arrives, and the progress frames before it."""

    __slots__ = ("_event", "_reply", "_error", "_channel", "_call_id", "_progress", "_moved")

    @property
    def call_id(self) -> int:
        """The call's id on its connection (a ``LayersWritten`` names its store by it)."""
        return self._call_id

    def __init__(self, channel: "Channel", call_id: int) -> None:
        self._event = threading.Event()
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self._channel, self._call_id = channel, call_id
        self._progress: LayersReady | None = None
        self._moved = threading.Condition(threading.Lock())

    def _set(self, reply: Reply | None, error: BaseException | None = None) -> None:
        with self._moved:
            self._reply, self._error = reply, error
            self._event.set()
            self._moved.notify_all()

    def _step(self, progress: LayersReady) -> None:
        with self._moved:
            self._progress = progress
            self._moved.notify_all()

    def progress(self, layers: int, timeout: float | None = None) -> LayersReady | None:
        """The latest progress frame once it covers ``layers`` layers; None when the call ended
        first (its ``result`` says how).

        Raises:
            Timeout: neither within ``timeout``.
        """
        with self._moved:
            ok = self._moved.wait_for(lambda: self._event.is_set() or (
                self._progress is not None and self._progress.layers >= layers), timeout)
            if not ok:
                raise Timeout(f"layer {layers - 1} not ready within {timeout} s")
            p = self._progress
            return p if p is not None and p.layers >= layers else None

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """The reply (a ``dataplane.messages`` reply type).

        Raises:
            Timeout: no reply within ``timeout``.
            RemoteError: the data plane answered with an ``ErrorReply`` (its subclass by kind).
            DataPlaneUnavailable: the connection broke before the reply.
        """
        if not self._event.wait(timeout):
            self._channel._forget(self._call_id)
            raise Timeout(f"no reply within {timeout} s")
        if self._error is not None:
            raise self._error
        if isinstance(self._reply, ErrorReply):
            raise error_for(self._reply)
        return self._reply


def unreachable(address: str, exc: OSError) -> str:
    """Why a connect to the data plane at ``address`` failed, and what to do. A socket that
    refuses this process (EACCES, EPERM) is the service's: mode 0600, owned by the uid that runs
    ``kvblend serve``, and only that uid may connect (docs/security.md); anything else means no
    data plane listens there."""
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return f"no data plane at {address}: {exc}"
    try:
        owner = f"uid {os.stat(address).st_uid}"
    except OSError:
        owner = "the service's uid"
    return (f"the data plane's socket {address} refuses this process (uid {os.geteuid()}): "
            f"{exc.strerror}. It belongs to {owner}, the uid that runs kvblend serve, and only "
            "that uid may connect: run the engine as that uid, or the service as the engine's "
            "(docs/security.md, 'Principals and channels')")


class Channel:
    """A thread-safe client connection to the data plane at ``address`` (a Unix socket path).

    Args:
        address: the data plane's socket (``dataplane.default_address(prefix)``).
        connect_timeout: seconds to wait for the data plane to accept (posix_ipc rule).
    """

    def __init__(self, address: str, connect_timeout: float | None = 5.0) -> None:
        self.address = address
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()        # guards connect/close and the pending table
        self._send_lock = threading.Lock()   # one frame at a time on the socket
        self._sock: socket.socket | None = None
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def call(self, msg: Any, timeout: float | None = None) -> Any:
        """Send ``msg`` and return its reply (see ``Pending.result`` for the errors)."""
        return self.submit(msg).result(timeout)

    def submit(self, msg: Any) -> Pending:
        """Send ``msg`` now; the reply arrives in the returned ``Pending``."""
        call_id = next(self._ids)
        pending = Pending(self, call_id)
        data = frame(call_id, msg)
        with self._lock:
            sock = self._connected()
            self._pending[call_id] = pending
        try:
            with self._send_lock:
                sock.sendall(data)
        except OSError as exc:
            self._broken(sock, exc)
        return pending

    def send(self, msg: Any) -> None:
        """Send ``msg``, which has no reply (``LayersWritten``).

        Raises:
            DataPlaneUnavailable: no connection, or it broke.
        """
        data = frame(next(self._ids), msg)
        with self._lock:
            sock = self._connected()
        try:
            with self._send_lock:
                sock.sendall(data)
        except OSError as exc:
            self._broken(sock, exc)
            raise DataPlaneUnavailable(f"connection to the data plane lost: {exc}") from exc

    def _connected(self) -> socket.socket:
        if self._closed:
            raise DataPlaneUnavailable("channel is closed")
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout)
        try:
            sock.connect(self.address)
        except OSError as exc:
            sock.close()
            raise DataPlaneUnavailable(unreachable(self.address, exc)) from exc
        sock.settimeout(None)
        self._sock = sock
        threading.Thread(target=self._read, args=(sock,), name="dataplane-channel-reader",
                         daemon=True).start()
        return sock

    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                got = recv_frame(sock)
                if got is None:
                    raise ConnectionError("the data plane closed the connection")
                call_id, payload = got
                reply = reply_decoder.decode(payload)
                with self._lock:
                    if isinstance(reply, LayersReady):  # progress: the call goes on
                        pending = self._pending.get(call_id)
                    else:
                        pending = self._pending.pop(call_id, None)
                if pending is not None:
                    if isinstance(reply, LayersReady):
                        pending._step(reply)
                    else:
                        pending._set(reply)
        except Exception as exc:  # any broken stream ends the connection, never the process
            self._broken(sock, exc)

    def _broken(self, sock: socket.socket, exc: BaseException) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
            stranded, self._pending = self._pending, {}
        try:
            sock.close()
        except OSError:
            pass
        for pending in stranded.values():
            pending._set(None, DataPlaneUnavailable(f"connection to the data plane lost: {exc}"))

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._pending.pop(call_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Channel", "Pending", "recv_frame", "unreachable"]
