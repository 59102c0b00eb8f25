"""The engine client's control seam: registration, unregistration and lookup, over HTTP to the API
(``HttpControl``) or straight to the data plane and the shared-memory store (``DirectControl``,
for engines on a service without an API, tests and benchmarks).

``BlendClient`` holds one of them and never asks which; stores and retrieves always go over the
data-plane channel. Only ``DirectControl.lookup`` needs the store's kernels: it imports them on
first use, so an engine on the HTTP path never loads numba.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import httpx
import msgspec
import numpy as np

from kvblend.dataplane.channel import Channel
from kvblend.dataplane.errors import DataPlaneUnavailable, http_error
from kvblend.dataplane.messages import Registered, RegisterInstance, UnregisterInstance
from kvblend.dataplane.registration import Registration
from kvblend.shm.matches import LookupResult, Match


class Control(Protocol):
    """What the client asks of the service besides transfers."""

    def register(self, reg: Registration, request_id: str | None = None
                 ) -> tuple[int, str, float]:
        """Register a buffer; (instance id, instance token, lease seconds)."""

    def unregister(self, instance_id: int, token: str) -> None: ...

    def lookup(self, tokens: np.ndarray, model_name: str, world_size: int,
               cache_salt: str, standalone_only: bool = False) -> LookupResult: ...

    def close(self) -> None: ...


class HttpControl:
    """Control through the API at ``url``; HTTP errors come back as ``dataplane.errors``."""

    def __init__(self, url: str, api_token: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

    def dataplane_address(self) -> str:
        return str(self.request("GET", "/v1/status").json()["dataplane"]["address"])

    def register(self, reg: Registration, request_id: str | None = None
                 ) -> tuple[int, str, float]:
        headers = {"content-type": "application/json"}
        if request_id:
            headers["X-Request-ID"] = request_id
        got = self.request("POST", "/v1/instances", content=msgspec.json.encode(reg),
                           headers=headers).json()
        return int(got["instance_id"]), str(got["instance_token"]), float(got["lease_s"])

    def unregister(self, instance_id: int, token: str) -> None:
        self.request("DELETE", f"/v1/instances/{instance_id}",
                     headers={"X-Instance-Token": token})

    def lookup(self, tokens: np.ndarray, model_name: str, world_size: int,
               cache_salt: str, standalone_only: bool = False) -> LookupResult:
        # the binary body: little-endian uint32 ids, the other fields as query parameters (no
        # JSON encoding of tens of thousands of ids on either side)
        params = {"model_name": model_name, "world_size": world_size, "cache_salt": cache_salt,
                  "standalone_only": "true" if standalone_only else "false"}
        data = self.request("POST", "/v1/lookup", params=params,
                            content=tokens.astype("<u4").tobytes(),
                            headers={"content-type": "application/octet-stream"}).json()
        matches = [Match(m["old_st"], m["old_ed"], m["cur_st"], m["cur_ed"],
                         bytes.fromhex(m["chunk_hash"]), m["origin"],
                         m.get("location", "local")) for m in data["matches"]]
        return LookupResult(matches, int(data["hit_tokens"]), int(data["requested_tokens"]))

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request; an error answer raises the exception its problem names.

        Raises:
            DataPlaneUnavailable: the API does not answer.
        """
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise DataPlaneUnavailable(f"kvblend API unreachable: {exc}") from exc
        if resp.status_code >= 400:
            try:
                problem = resp.json()
                detail, code = str(problem.get("detail", resp.text)), str(problem.get("code", ""))
            except (ValueError, AttributeError):
                detail, code = resp.text, ""
            raise http_error(resp.status_code, code,
                             f"{method} {path}: HTTP {resp.status_code}: {detail}")
        return resp

    def close(self) -> None:
        self._http.close()


class DirectControl:
    """Control over the data-plane channel; lookups in the store of ``prefix`` in this process."""

    def __init__(self, channel: Channel, prefix: str, chunk_size: int, timeout: float) -> None:
        self._channel, self._prefix, self._chunk, self._timeout = channel, prefix, chunk_size, timeout
        self._shared: tuple[Any, Any] | None = None
        self._lock = threading.Lock()

    def register(self, reg: Registration, request_id: str | None = None
                 ) -> tuple[int, str, float]:
        reply: Registered = self._channel.call(
            RegisterInstance(registration=reg, request_id=request_id), self._timeout)
        return reply.instance_id, reply.token, reply.lease_s

    def unregister(self, instance_id: int, token: str) -> None:
        self._channel.call(UnregisterInstance(instance_id=instance_id, token=token),
                           self._timeout)

    def lookup(self, tokens: np.ndarray, model_name: str, world_size: int,
               cache_salt: str, standalone_only: bool = False) -> LookupResult:
        from kvblend.shm.hashing import Namespace
        from kvblend.shm.lookup import lookup
        store, fingerprints = self._attach()
        return lookup(store, fingerprints, Namespace(model_name, world_size, cache_salt), tokens,
                      standalone_only)

    def _attach(self) -> tuple[Any, Any]:
        with self._lock:
            if self._shared is None:  # the kernels load here, on the first direct lookup
                from kvblend.shm.fingerprint import FingerprintIndex
                from kvblend.shm.store import Store
                store = Store.open(self._prefix)
                self._shared = (store, FingerprintIndex.attach(self._prefix, self._chunk))
            return self._shared

    def close(self) -> None:
        if self._shared is not None:
            store, fingerprints = self._shared
            fingerprints.close()
            store.close()


__all__ = ["Control", "HttpControl", "DirectControl"]
