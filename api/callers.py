"""Who an HTTP registration is for: the key the data plane bounds registrations by.

This module owns the caller key that the instance route hands the data plane with each
registration (``RegisterInstance.caller``; the bounds themselves are ``dataplane.instances``'s).
It does not own who may call at all (``api.auth``).

A caller is::

    token:<16 hex>   the token it presented (a digest of the whole header value, never the
                     token), when the service has tokens: every holder of one token is one caller
    uid:<n>          else the uid of the process at the other end of a loopback TCP connection
                     (the kernel's socket table, /proc/net/tcp and tcp6, as identd reads it)
    addr:<host>      else its address (a remote peer, or one whose socket this host cannot see;
                     the connection's own: uvicorn reads no X-Forwarded-For, api.uvicorn_workers)

With no token configured a bearer header says nothing (anyone may send any), so it never makes
a new caller: a second local user is its own uid, however many headers it makes up, and the data
plane refuses it any registration (``dataplane.instances``: none of the service's buffers is its).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re

from starlette.types import Scope

from kvblend.api.auth import Role, Tokens, authorization, role_of

_SAFE = re.compile(r"[^0-9A-Za-z._:%\[\]-]")  # what a key may hold (``messages.Caller``)
_ESTABLISHED = "01"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def caller_of(scope: Scope) -> str:
    """The caller key of the HTTP request of ``scope`` (the table above)."""
    tokens: Tokens = scope["app"].state.tokens
    role = role_of(scope)  # a token counts only where it matched one the service has
    if role is Role.ADMIN and tokens.admin is not None or \
            role is Role.CLIENT and tokens.api is not None:
        return "token:" + hashlib.blake2b(authorization(scope["headers"])[0],
                                          digest_size=8).hexdigest()
    client, server = scope.get("client"), scope.get("server")
    if client is None:
        return "addr:unknown"
    uid = loopback_uid((client[0], client[1]), server) if server else None
    if uid is not None:
        return f"uid:{uid}"
    return "addr:" + _SAFE.sub("_", str(client[0]))[:64]


def loopback_uid(client: tuple[str, int], server: tuple[str, int | None]) -> int | None:
    """The uid owning the TCP socket at ``client`` connected to ``server``, when both are
    loopback addresses of this host's network namespace; else None."""
    try:
        if not (ipaddress.ip_address(client[0]).is_loopback and server[1] is not None):
            return None
    except ValueError:  # a host name (a test client), not an address
        return None
    want = (_endpoint(client[0], client[1]), _endpoint(server[0], int(server[1])))
    for table in _TABLES:
        try:
            with open(table) as f:
                next(f, None)  # the header line
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and fields[3] == _ESTABLISHED and \
                            (_parse(fields[1]), _parse(fields[2])) == want:
                        return int(fields[7])
        except OSError:
            continue
    return None


def _endpoint(host: str, port: int) -> tuple[ipaddress.IPv6Address, int]:
    """``host:port`` as an IPv6 address (an IPv4 one mapped) and port, to compare both tables."""
    return _mapped(ipaddress.ip_address(host.split("%")[0])), port


def _parse(field: str) -> tuple[ipaddress.IPv6Address, int]:
    """One ``ADDR:PORT`` of the kernel's table: the address in host-order 32-bit words, hex."""
    addr, port = field.split(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    return _mapped(ipaddress.ip_address(raw)), int(port, 16)


def _mapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    """``ip`` as IPv6: an IPv4 address mapped (``::ffff:a.b.c.d``), as tcp6 lists one."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ipaddress.IPv6Address(f"::ffff:{ip}")
    return ip


__all__ = ["caller_of", "loopback_uid"]
