"""The remote tier's URL (``--remote``): what a URL may say, parsed once, where it is set (the
service's settings), into the one ``RemoteURL`` that the data plane receives in its settings and
``dataplane.remote`` connects with. Standard library and msgspec only, so the service's settings
take it without loading the tier."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}


class RemoteURL(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A parsed remote URL; ``str()`` gives it back as a URL (it holds no credentials).

    Attributes:
        cluster: cluster mode, from seed nodes (``redis+cluster://``, ``rediss+cluster://``).
        tls: TLS (``rediss://``, ``rediss+cluster://``).
        nodes: ``(host, port)`` of the server, or of the cluster's seed nodes.
        db: a standalone server's database number.
    """

    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0

    @classmethod
    def parse(cls, url: str) -> "RemoteURL":
        """``redis://host:port/db``, ``rediss://`` for TLS, ``redis+cluster://h1:p1,h2:p2`` (or
        ``rediss+cluster``) for cluster mode from seed nodes.

        Raises:
            ValueError: another scheme, no host, credentials in the URL (they come from the
                environment, never from a command line), or a database number in cluster mode.
        """
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                f"a remote URL starts with one of {', '.join(s + '://' for s in SCHEMES)}")
        if "@" in parts.netloc:
            raise ValueError("a remote URL carries no credentials: set KVBLEND_REMOTE_USERNAME "
                             "and KVBLEND_REMOTE_PASSWORD instead (a command line is visible to "
                             "every user of the host)")
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
        return cls(cluster=cluster, tls=tls, nodes=tuple(nodes), db=int(path or 0))

    def __str__(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


__all__ = ["SCHEMES", "RemoteURL"]
