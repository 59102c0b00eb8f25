"""The remote tier's URL (``--remote``): what a URL may say, checked where it is set (the service's
settings) and parsed where it is used (``dataplane.remote``). Standard library only, so the API's
settings check a URL without loading the tier."""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}


def parse_url(url: str) -> tuple[bool, bool, list[tuple[str, int]], int]:
    """``(cluster, tls, [(host, port)], db)`` of a ``--remote`` URL: ``redis://host:port/db``,
    ``rediss://`` for TLS, ``redis+cluster://h1:p1,h2:p2`` (or ``rediss+cluster``) for cluster
    mode from seed nodes.

    Raises:
        ValueError: another scheme, no host, credentials in the URL (they come from the
            environment, never from a command line), or a database number in cluster mode.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"a remote URL starts with one of {', '.join(s + '://' for s in SCHEMES)}")
    if "@" in parts.netloc:
        raise ValueError("a remote URL carries no credentials: set KVBLEND_REMOTE_USERNAME and "
                         "KVBLEND_REMOTE_PASSWORD instead (a command line is visible to every "
                         "user of the host)")
    cluster, tls = SCHEMES[parts.scheme], parts.scheme.startswith("rediss")
    nodes = []
    for node in parts.netloc.split(","):
        host, _, port = node.rpartition(":") if ":" in node else (node, "", "6379")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{node!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not cluster and len(nodes) != 1:
        raise ValueError("several nodes need cluster mode (redis+cluster://)")
    path = parts.path.strip("/")
    if path and (cluster or not path.isdigit()):
        raise ValueError("only a standalone server's URL may name a database number")
    return cluster, tls, nodes, int(path or 0)


__all__ = ["SCHEMES", "parse_url"]
