"""Reading a range of a value into a caller's buffer: ``GETRANGE``'s reply taken off the wire here,
not by redis-py, so that megabytes of KV land in a slab slot without a Python bytes object of them.

This module owns that reader and everything it knows of redis-py's insides; no other module of the
remote tier reaches past redis-py's public API. It does not own the value's format or its checks
(``dataplane.remoteformat``), nor which ranges are read and when (``dataplane.remote``).

The direct reader (``range_reader(..., direct=True)``) takes a connection from the pool of the
server that holds the key, sends ``GETRANGE key lo hi`` and parses the RESP2 reply itself:
``$<n>\\r\\n``, then the n bytes received with ``recv_into`` straight into the caller's buffer, then
``\\r\\n``; an error line (MOVED, ASK, WRONGTYPE, ...) fails the call (``BadReply``). A connection
that failed mid-reply (timeout, reset, a reply not understood) is closed before it goes back to its
pool: the rest of that reply would otherwise be read as the answer to the connection's next command.

What it takes from redis-py besides the public API: ``ConnectionPool.get_connection()`` called
without a command name (redis-py 5.3 on; before, the name was required), a connection's socket
(``_sock``) and its parser (``_parser``), asked whether it holds bytes nobody read (the hiredis
parser's ``_reader.has_data()``, the Python one's ``_buffer.unread_bytes()``). Written against
redis-py 8.2; those names hold from 5.3 on (``tests/remote`` passes on 5.3, 6.4, 7.0 and 8.2, with
redis-py's Python parser). KNOWN_REDIS_PY is that range: from 5.3, below the next major, 9.

On a redis-py outside KNOWN_REDIS_PY the tier says so in its log when it starts (``direct_reads``)
and reads every range through redis-py's public ``getrange`` instead: the same bytes and the same
misses, at the cost of one more copy of each piece (and the first piece hashed once it is in,
not as it comes in). Nothing private of redis-py is touched then.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

#: the redis-py versions the direct reader knows: ``lo <= version < hi``, by leading numbers;
#: pyproject's redis requirement (extras ``remote`` and ``test``) is this range
KNOWN_REDIS_PY: tuple[tuple[int, ...], tuple[int, ...]] = ((5, 3), (9,))

Seen = Callable[[memoryview], object]
#: ``read(start, dest, seen)``: the value's bytes from ``start`` into ``dest`` (at most
#: ``len(dest)``; ``seen``, when given, gets each span of them as it is in), how many there were
ReadAt = Callable[[int, memoryview, Seen | None], int]

_LINE = 256  # bytes received for a reply's first line: ``$<n>\r\n`` fits with room to spare

log = logging.getLogger("kvblend.dataplane")


class BadReply(Exception):
    """A range's reply was not the bulk string asked for: an error line, bytes that are not RESP2,
    or the connection closed mid-reply."""


def version_numbers(version: str) -> tuple[int, ...] | None:
    """The leading numbers of a version string (``"8.2.0b1"``: ``(8, 2, 0)``), None without any."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group().split(".")) if m else None


def knows(version: str) -> bool:
    """Whether redis-py ``version`` lies in KNOWN_REDIS_PY."""
    numbers = version_numbers(version)
    lo, hi = KNOWN_REDIS_PY
    return numbers is not None and lo <= numbers < hi


def direct_reads(version: str) -> bool:
    """Whether to read ranges off the socket with redis-py ``version`` (``range_reader``'s
    ``direct``): only a version this module knows. Any other is named in the log (the tier asks
    once, when it is made) and its ranges go through redis-py's ``getrange``."""
    if knows(version):
        return True
    lo, hi = (".".join(map(str, v)) for v in KNOWN_REDIS_PY)
    log.warning("redis-py %s is not one the remote tier's reader knows (>=%s,<%s): remote reads "
                "go through redis-py's GETRANGE, one more copy of the KV", version, lo, hi)
    return False


def range_reader(client: Any, cluster: bool, key: str, direct: bool) -> ReadAt:
    """A reader of ``key``'s value at any offset: off a pooled connection's socket of the server
    that holds the key (``direct``; module docstring), else through redis-py's ``getrange``.

    Args:
        client: the ``redis.Redis`` or ``redis.cluster.RedisCluster`` that holds the key.
        cluster: whether ``client`` is a cluster client.
        key: the value's key; every read of this reader goes to the server that holds it now.
        direct: ``direct_reads`` of the installed redis-py.
    """
    if not direct:
        return lambda start, dest, seen: _getrange_copy(client, key, start, dest, seen)
    pool = _pool_of(client, cluster, key)
    return lambda start, dest, seen: _getrange_into(pool, key, start, dest, seen)


def _pool_of(client: Any, cluster: bool, key: str) -> Any:
    """The connection pool of the server that holds ``key`` (in a cluster: its slot's master,
    as the slot map the client holds says)."""
    if not cluster:
        return client.connection_pool
    return client.get_redis_connection(client.get_node_from_key(key)).connection_pool


def _getrange_copy(client: Any, key: str, start: int, dest: memoryview, seen: Seen | None) -> int:
    """``GETRANGE`` through redis-py's public API: its reply as bytes, then copied into ``dest``."""
    got = client.getrange(key, start, start + len(dest) - 1)
    if len(got) > len(dest):
        raise BadReply(f"{len(got)} bytes for a range of at most {len(dest)}")
    dest[:len(got)] = got
    if seen is not None:
        seen(dest[:len(got)])
    return len(got)


def _buffered(conn: Any) -> bool:
    """Whether redis-py's parser of ``conn`` holds received bytes it has not parsed: the hiredis
    parser in its ``_reader``, the Python one (RESP2) in its ``_buffer``, a ``SocketBuffer``."""
    reader = getattr(conn._parser, "_reader", None)
    if reader is not None:
        return bool(reader.has_data())
    buffer = getattr(conn._parser, "_buffer", None)
    return buffer is not None and buffer.unread_bytes() > 0


def _getrange_into(pool: Any, key: str, start: int, dest: memoryview, seen: Seen | None) -> int:
    """``GETRANGE key start start+len(dest)-1`` on a connection of ``pool``, its reply received
    into ``dest`` (``seen`` given each span of it as it comes in): the bytes the value had there.
    A connection that fails is closed before it goes back (module docstring)."""
    conn = pool.get_connection()
    try:
        if _buffered(conn):  # the pool checks it too: a stray byte would shift every reply after
            raise BadReply("a pooled connection holds bytes nobody read")
        conn.send_command("GETRANGE", key, start, start + len(dest) - 1)
        return _recv_bulk(conn._sock, dest, seen)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _recv_bulk(sock: Any, dest: memoryview, seen: Seen | None) -> int:
    """One RESP2 bulk reply of at most ``len(dest)`` bytes, received into ``dest``: its length.

    Raises:
        BadReply: an error line, another reply, a longer one, or the socket closed.
        OSError: a receive failed or timed out (the socket's timeout).
    """
    line, early = _recv_line(sock)
    if line[:1] == b"-":
        raise BadReply(line[1:].decode(errors="replace"))
    if line[:1] != b"$" or not line[1:].isdigit() or int(line[1:]) > len(dest):
        raise BadReply(f"{line[:32]!r} for a bulk string of at most {len(dest)} bytes")
    n = int(line[1:])
    k = min(early.nbytes, n)
    dest[:k] = early[:k]
    if seen is not None:
        seen(dest[:k])
    _recv_exact(sock, dest[k:n], seen)
    _recv_crlf(sock, early[k:])
    return n


def _recv_crlf(sock: Any, early: memoryview) -> None:
    """The CRLF that ends a bulk string, of which ``early`` holds the bytes received already."""
    if early.nbytes > 2:
        raise BadReply("bytes after the reply")
    end = bytearray(2)
    end[:early.nbytes] = early
    _recv_exact(sock, memoryview(end)[early.nbytes:])
    if end != b"\r\n":
        raise BadReply(f"{bytes(end)!r} after a bulk string")


def _recv_line(sock: Any) -> tuple[bytes, memoryview]:
    """A reply's first line, less its CRLF, and the bytes received after it. The socket holds
    one reply at most, so nothing received here belongs to another."""
    buf = bytearray(_LINE)
    filled = 0
    while (end := buf.find(b"\r\n", 0, filled)) < 0:
        if filled == _LINE:
            raise BadReply(f"a reply line longer than {_LINE} bytes: {bytes(buf[:32])!r}")
        filled += _recv_some(sock, memoryview(buf)[filled:])
    return bytes(buf[:end]), memoryview(buf)[end + 2:filled]


def _recv_exact(sock: Any, view: memoryview, seen: Seen | None = None) -> None:
    while view.nbytes:
        got = _recv_some(sock, view)
        if seen is not None:  # while this runs, the kernel buffers what the server sends next
            seen(view[:got])
        view = view[got:]


def _recv_some(sock: Any, view: memoryview) -> int:
    got = sock.recv_into(view)
    if got == 0:
        raise BadReply("the server closed the connection mid-reply")
    return int(got)


__all__ = ["KNOWN_REDIS_PY", "BadReply", "ReadAt", "Seen", "direct_reads", "knows", "range_reader",
           "version_numbers"]
