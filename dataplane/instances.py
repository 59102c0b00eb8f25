"""Registered engine buffers: the table of instances, their capabilities, leases and persistence.

This module owns the instance table of one data-plane process: registration and its checks, the
capabilities and leases, dropping an instance and re-opening the saved ones. One instance's
worker and calls in flight are ``dataplane.instance``'s; the saved table's format is
``dataplane.statefile``'s.

An instance is a capability (docs/security.md): registration draws a token of 128 random bits,
and every call on the instance must present it (``Registry.authorize``). Its life is a lease, not
a pid (pids do not cross containers): every authorized call renews it, and ``expired()`` names the
instances whose owner renewed nothing for ``lease_s`` seconds.

State of one instance::

    registered --authorize (any call with its token)--> registered, lease renewed
    registered --UnregisterInstance / lease ran out--> dropping (its queued calls still run)
    registered or dropping --lease ran out--> its buffer released (``InstanceBuffer.release``:
                                              no wait for the engine holds its worker)
    dropping --its worker reaches the drop job--> gone: buffer closed, layout class released
                                                  when no instance uses it and it holds no page

Registration checks everything (limits, names, geometry, the namespace's layout, the buffer
opened and measured) before it creates anything: a refused registration leaves no instance, no
layout class and no saved state. The fields' own bounds were checked by the decoder that made the
``Registration`` (``dataplane.registration``).

Registrations over HTTP (``RegisterInstance.caller`` set: the API registers for that caller)
are bounded apart from the socket's, so that no HTTP caller can keep engines out::

    max_instances    every instance; an engine on the socket may take the last free slot
    http_instances   instances registered over HTTP, all callers together: all but a quarter
                     of max_instances (rounded down), the reserve that only the socket takes
    max_per_client   instances of one connection (an engine on the socket), or of one HTTP
                     caller (one token, else one peer: ``api.callers``), whatever connection
                     of which API worker carried its registrations

and an HTTP registration that names a buffer (shm name, CUDA IPC handle) a live instance of
another caller holds is refused (``BufferInUse``): a caller registers only what it holds or what
nobody has registered. An HTTP caller known by its uid (a loopback peer) registers only as the
service's uid: another local user owns none of its buffers, and could otherwise register an
engine's new buffer (its name is listed in /dev/shm) before the engine does. An engine on the
socket is trusted with its uid's buffers, as before.

The table is saved on every change (``dataplane.statefile``), tokens included: a restarted data
plane re-opens every instance under the same id and token with a fresh lease, so engines keep
working across a data-plane restart. The data plane unlinks an engine's buffer only after the
instance's lease ran out and ``shm.kvbufs`` proved its owner gone (``dataplane.server``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from kvblend.dataplane import statefile
from kvblend.dataplane.backend import CopyEngine, InstanceBuffer
from kvblend.dataplane.errors import (BadRequest, BufferInUse, Forbidden, LayoutMismatch, TooMany,
                                      UnknownInstance)
from kvblend.dataplane.instance import Instance
from kvblend.dataplane.messages import TOKEN_HEX
from kvblend.dataplane.registration import (BufferKind, BufferSpec, PagedBuffer, Registration,
                                            ShmBuffer)
from kvblend.shm import errors as shm_errors
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.names import Names
from kvblend.shm.store import Store

log = logging.getLogger("kvblend.dataplane")


@dataclass(frozen=True)
class Limits:
    """Bounds of one data plane (docs/security.md has the defaults and why).

    Attributes:
        lease_s: seconds an instance lives without a renewal.
        max_instances: instances of the whole data plane.
        max_per_client: instances one connection, or one HTTP caller, may register.
    """

    lease_s: float = 30.0
    max_instances: int = 256
    max_per_client: int = 64

    @property
    def http_instances(self) -> int:
        """Instances registrations over HTTP may hold together: all but the engines' reserve, a
        quarter of ``max_instances``, rounded down."""
        return self.max_instances - self.max_instances // 4


class Registry:
    """The instances of one data plane.

    Args:
        prefix: the store prefix (names the saved table).
        store: the attached store (layout classes).
        engine: opens buffers.
        chunk_size: tokens per chunk of this service.
        limits: lease and instance bounds.
    """

    def __init__(self, prefix: str, store: Store, engine: CopyEngine, chunk_size: int,
                 limits: Limits | None = None) -> None:
        self._path = Names(prefix).state
        self._store, self._engine, self._chunk = store, engine, chunk_size
        self.limits = limits or Limits()
        self._lock = threading.Lock()       # the table
        self._reg_lock = threading.Lock()   # one registration at a time: check, open, create
        self._by_id: dict[int, Instance] = {}
        self._next_id = 1

    # -- registration -----------------------------------------------------------------------

    def register(self, req: Registration, owner_uid: int, client: int | None,
                 saved: tuple[int, str] | None = None, request_id: str | None = None,
                 caller: str | None = None) -> Instance:
        """Check everything, then open the buffer and start the instance's worker.

        Args:
            req: the registration, decoded (its fields within their bounds).
            owner_uid: the registering peer's uid; an shm buffer must belong to it.
            client: the registering connection (per-client limit); None for a restored one.
            saved: (id, token) of an instance a previous data plane saved.
            request_id: the call's, for the log.
            caller: the HTTP caller the API registers for; None for the connection itself.

        Raises:
            BadRequest: bad names, layout fields or dtype, a buffer that is not the client's, or
                an HTTP caller the kernel names as another uid than ``owner_uid``.
            LayoutMismatch: the namespace's chunks were stored with another layout (or
                ``shm.errors.LayoutMismatch`` from the store).
            TooMany: the instance limits are reached.
            BufferInUse: an HTTP caller names a buffer another caller's live instance holds.
            shm.errors.CapacityError: every layout class holds chunks or instances.
            BackendError: the buffer cannot be mapped.
        """
        layout, cc = _layout_of(req, self._chunk)
        self._check_rotary(req)
        with self._reg_lock:
            if saved is None:
                _check_caller(caller, owner_uid)
            self._check_limits(client, caller)
            if saved is None:
                self._check_free(req, caller)
            self._check_namespace_layout(cc)
            buffer = self._engine.open(req.buffer, layout, owner_uid, req.order_word,
                                       req.ready_word)
            try:
                class_id = self._register_class(cc)
            except BaseException:
                buffer.close()
                raise  # the server answers by dataplane.errors.FROM_SHM
            inst = self._insert(req, layout, class_id, buffer, owner_uid, (client, caller),
                                saved)
        inst.start()
        log.info("registered instance %d (%s, ws=%d, worker=%s, layout=%s, uid=%d) request_id=%s",
                 inst.id, req.model_name, req.world_size, req.worker_id, layout.shape, owner_uid,
                 request_id)
        return inst

    def _check_rotary(self, req: Registration) -> None:
        """Refuse a rotary config that does not fit the buffer or fails
        ``dataplane.rotary.check`` (float64 numpy: no torch import on the connection's thread).

        Raises:
            BadRequest: naming what does not fit.
        """
        cfg = req.rotary
        if cfg is None:
            return
        head = req.buffer.head_dim if isinstance(req.buffer, PagedBuffer) else cfg.head_dim
        if cfg.head_dim != head or req.hidden_dim % cfg.head_dim:
            raise BadRequest(f"rotary head_dim {cfg.head_dim} does not fit the buffer "
                             f"(hidden_dim {req.hidden_dim}, head_dim {head})")
        from kvblend.dataplane import rotary
        try:
            rotary.check(cfg)
        except ValueError as exc:
            raise BadRequest(f"rotary: {exc}") from exc

    def _register_class(self, cc: ChunkClass) -> int:
        """The id of ``cc``'s layout class. When every row of the class table is taken, first
        give back the rows of classes that hold no chunk and that no instance uses: a class whose
        chunks were evicted or cleared after its last instance went is released by nobody else,
        and without this a store that has seen ``max_classes`` models refuses every new one."""
        try:
            return self._store.register_class(cc)
        except shm_errors.CapacityError:
            in_use = self._classes_in_use()
            released = [c for c in range(self._store.config.max_classes)
                        if c not in in_use and self._store.release_class(c)]
            if not released:
                raise
            log.info("released %d layout classes (no chunks, no instances)", len(released))
            return self._store.register_class(cc)

    def _insert(self, req: Registration, layout: KVLayout, class_id: int,
                buffer: InstanceBuffer, owner_uid: int, by: tuple[int | None, str | None],
                saved: tuple[int, str] | None) -> Instance:
        with self._lock:
            iid, token = saved if saved is not None else (self._next_id, secrets.token_hex(16))
            assert len(token) == TOKEN_HEX, "tokens are 128 bits in hex"
            self._next_id = max(self._next_id, iid + 1)
            inst = Instance(iid, token, req, layout, class_id, buffer, owner_uid, by[0],
                            time.monotonic() + self.limits.lease_s, caller=by[1])
            self._by_id[iid] = inst
            try:
                self._save()
            except BaseException:
                del self._by_id[iid]
                buffer.close()
                raise
        return inst

    def _check_limits(self, client: int | None, caller: str | None) -> None:
        """Refuse a registration past ``max_instances``; then one of a connection past its
        share, or one over HTTP past the HTTP path's or its caller's share (``Limits``)."""
        with self._lock:
            live = list(self._by_id.values())
        limits = self.limits
        if len(live) >= limits.max_instances:
            raise TooMany(f"this data plane holds {len(live)} instances, its limit "
                          "(--max-instances): unregister some first")
        if caller is None:
            mine = sum(1 for i in live if client is not None and i.client == client)
            if mine >= limits.max_per_client:
                raise TooMany(f"this connection holds {mine} instances, the per-client limit "
                              "(--max-instances-per-client)")
            return
        http = [i for i in live if i.caller is not None]
        if len(http) >= limits.http_instances:
            raise TooMany(f"registrations over HTTP hold {len(http)} instances, all but the "
                          f"{limits.max_instances - limits.http_instances} this data plane "
                          "keeps for engines on its socket (--max-instances)")
        mine = sum(1 for i in http if i.caller == caller)
        if mine >= limits.max_per_client:
            raise TooMany(f"this caller holds {mine} instances registered over HTTP, the "
                          "per-client limit (--max-instances-per-client)")

    def _check_free(self, req: Registration, caller: str | None) -> None:
        """Refuse an HTTP caller a buffer or order word that a live instance of another caller
        (or an engine on the socket) holds: it would read and write another engine's KV, or
        release its order word.

        Raises:
            BufferInUse: naming the instance that holds it.
        """
        if caller is None:
            return  # an engine on the socket: its uid's buffers are its own
        names = memory_names(req)
        for inst in self.all():
            if inst.caller != caller and not inst.dropping and \
                    names & memory_names(inst.request):
                raise BufferInUse(f"instance {inst.id}, registered by another caller, holds "
                                  "this buffer: a caller registers only buffers it holds")

    def _classes_in_use(self) -> set[int]:
        with self._lock:
            return {i.class_id for i in self._by_id.values()}

    def _check_namespace_layout(self, cc: ChunkClass) -> None:
        """Refuse another layout for a namespace while chunks or instances of its layout exist;
        a class of the namespace that holds neither is released (the model may change layout
        once its chunks are evicted or cleared)."""
        in_use = self._classes_in_use()
        for c in range(self._store.config.max_classes):
            try:
                other = self._store.chunk_class(c)
            except KeyError:
                continue
            if other.model_name == cc.model_name and other.world_size == cc.world_size and \
                    other.chunk_size == cc.chunk_size and other != cc:
                if c not in in_use and self._store.release_class(c):
                    log.info("released layout class %d of %r (no chunks, no instances)", c,
                             cc.model_name)
                    continue
                raise LayoutMismatch(
                    f"model {cc.model_name!r} (world_size {cc.world_size}) is stored with "
                    f"L={other.num_layers}, D={other.hidden_dim}, {other.dtype}; this buffer has "
                    f"L={cc.num_layers}, D={cc.hidden_dim}, {cc.dtype}")

    # -- capabilities and leases ------------------------------------------------------------

    def authorize(self, instance_id: int, token: str) -> Instance:
        """The instance, its lease renewed, when ``token`` is its token.

        Raises:
            UnknownInstance: no such instance (or it is being dropped).
            Forbidden: the token is missing or wrong.
        """
        inst = self.get(instance_id)
        if not hmac.compare_digest(token.encode(), inst.token.encode()):
            raise Forbidden(f"wrong or missing token for instance {instance_id}")
        inst.expires = time.monotonic() + self.limits.lease_s
        return inst

    def claim_drop(self, inst: Instance) -> bool:
        """Mark ``inst`` as dropping; False when someone already did (drop it once)."""
        with self._lock:
            if inst.dropping:
                return False
            inst.dropping = True
            return True

    def expired(self) -> list[Instance]:
        """Instances whose lease ran out and that are not dropped yet, unless they are being
        dropped with their buffer released (an unregistration queued behind a call that waits
        for a gone engine is released once the lease runs out too)."""
        now = time.monotonic()
        return [i for i in self.all()
                if i.expires < now and not (i.dropping and i.buffer.released)]

    # -- the table --------------------------------------------------------------------------

    def remove(self, inst: Instance) -> None:
        """Drop ``inst`` from the table, wait for its calls in flight, close its buffer, release
        its layout class when no instance uses it and it holds no chunk (on the instance's own
        worker thread)."""
        inst.settle()
        with self._lock:
            self._by_id.pop(inst.id, None)
            in_use = any(i.class_id == inst.class_id for i in self._by_id.values())
            self._save()
        inst.buffer.close()
        if not in_use and self._store.release_class(inst.class_id):
            log.info("released layout class %d (no chunks, no instances)", inst.class_id)
        log.info("unregistered instance %d", inst.id)

    def get(self, instance_id: int) -> Instance:
        with self._lock:
            inst = self._by_id.get(instance_id)
        if inst is None or inst.dropping:
            raise UnknownInstance(f"no instance {instance_id}")
        return inst

    def all(self) -> list[Instance]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda i: i.id)

    # -- persistence ------------------------------------------------------------------------

    def _save(self) -> None:
        statefile.save(self._path, self._next_id, self._by_id.values())

    def restore(self) -> list[int]:
        """Re-open the instances a previous data plane saved; returns their ids.

        Raises:
            ForeignObject: the saved table exists but is not the service's own file.
        """
        table = statefile.load(self._path)
        self._next_id = max(self._next_id, table.next_id)
        back = []
        for item in table.instances:
            try:
                self.register(item.request, item.owner_uid, None, (item.instance_id, item.token),
                              caller=item.caller)
                back.append(item.instance_id)
            except Exception as exc:
                log.warning("could not re-open instance %d: %s", item.instance_id, exc)
        with self._lock:
            self._save()
        return back


def buffer_names(spec: BufferSpec) -> set[tuple[str, str | bytes]]:
    """What names the memory of ``spec``: each shm object's name, each CUDA allocation's IPC
    handle (the same allocation has the same handle whatever the offset into it)."""
    if isinstance(spec, PagedBuffer):
        return set().union(*(buffer_names(b) for b in spec.buffers))
    if isinstance(spec, ShmBuffer):
        return {(BufferKind.SHM.value, spec.name)}
    return {(BufferKind.CUDA_IPC.value, spec.handle)}


def memory_names(req: Registration) -> set[tuple[str, str | bytes]]:
    """``buffer_names`` of a registration's buffer and of its order word."""
    names = buffer_names(req.buffer)
    return names | buffer_names(req.order_word) if req.order_word is not None else names


def _layout_of(req: Registration, chunk_size: int) -> tuple[KVLayout, ChunkClass]:
    try:
        if req.worker_id is not None and not 0 <= req.worker_id < req.world_size:
            raise ValueError(f"worker_id {req.worker_id} outside [0, {req.world_size})")
        layout = KVLayout(req.num_layers, req.num_tokens, req.hidden_dim, DType.parse(req.dtype))
        return layout, ChunkClass.of(req.model_name, req.world_size, layout, chunk_size)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def _check_caller(caller: str | None, owner_uid: int) -> None:
    """Refuse an HTTP caller that the kernel names as another uid than the registering peer's
    (the API's, which is the service's): no buffer of that uid is its own.

    Raises:
        BadRequest: naming the caller.
    """
    if caller is not None and caller.startswith("uid:") and caller != f"uid:{owner_uid}":
        raise BadRequest(f"a registration over HTTP from {caller}: only processes of uid "
                         f"{owner_uid}, the service's, register its buffers")


__all__ = ["Limits", "Registry", "buffer_names", "memory_names"]
