"""Registered engine buffers: the table of instances, their worker threads, and its persistence.

This module owns the instance table of one data-plane process. Each instance has its own FIFO
queue and worker thread: calls for one instance run in the order they arrived (and its GPU work
on its own stream), calls for different instances run concurrently.

The table is also saved (atomically, on every change) to ``/dev/shm/{prefix}_dataplane.json``:
a restarted data plane re-opens every instance whose owner process is still alive, under the same
id, so engines keep working across a data-plane restart. An instance whose owner process died is
dropped (and its shm buffer unlinked: its creator is gone).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dataplane.backend import CopyEngine, InstanceBuffer
from dataplane.errors import BadRequest, LayoutMismatch, UnknownInstance
from dataplane.messages import InstanceInfo, RegisterInstance, ShmBuffer
from shm import errors as shm_errors
from shm.layout import ChunkClass, DType, KVLayout
from shm.lock import SHM_DIR, pid_alive
from shm.segment import unlink as unlink_segment
from shm.store import Store

log = logging.getLogger("kvblend.dataplane")

Job = Callable[["Instance"], bool]  # returns False to stop the worker


class Saved(msgspec.Struct):
    instance_id: int
    request: RegisterInstance


@dataclass
class Instance:
    id: int
    request: RegisterInstance
    layout: KVLayout
    class_id: int
    buffer: InstanceBuffer
    jobs: "queue.SimpleQueue[Job]" = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None

    @property
    def rank(self) -> int:
        return self.request.worker_id or 0

    def info(self) -> InstanceInfo:
        r = self.request
        return InstanceInfo(instance_id=self.id, model_name=r.model_name, world_size=r.world_size,
                            worker_id=r.worker_id, num_layers=r.num_layers,
                            num_tokens=r.num_tokens, hidden_dim=r.hidden_dim,
                            dtype=str(self.layout.dtype),
                            buffer_kind="shm" if isinstance(r.buffer, ShmBuffer) else "cuda_ipc",
                            owner_pid=r.owner_pid)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if not job(self):
                    return
            except BaseException:  # a job reports its own errors; never lose the worker
                log.exception("instance %d: job failed", self.id)


def state_path(prefix: str) -> str:
    return os.path.join(SHM_DIR, f"{prefix}_dataplane.json")


class Registry:
    """The instances of one data plane.

    Args:
        prefix: the store prefix (names the saved table).
        store: the attached store (layout classes).
        engine: opens buffers.
        chunk_size: tokens per chunk of this service.
    """

    def __init__(self, prefix: str, store: Store, engine: CopyEngine, chunk_size: int) -> None:
        self._path = state_path(prefix)
        self._store, self._engine, self._chunk = store, engine, chunk_size
        self._lock = threading.Lock()
        self._by_id: dict[int, Instance] = {}
        self._next_id = 1

    # -- registration -----------------------------------------------------------------------

    def register(self, req: RegisterInstance, instance_id: int | None = None) -> Instance:
        """Open the buffer and start the instance's worker.

        Raises:
            BadRequest: bad layout fields or dtype, world_size/worker_id out of range.
            LayoutMismatch: the namespace's chunks were stored with another layout.
            BackendError: the buffer cannot be opened.
        """
        layout = _layout_of(req)
        try:
            cc = ChunkClass.of(req.model_name, req.world_size, layout, self._chunk)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        self._check_namespace_layout(cc)
        try:
            class_id = self._store.register_class(cc)
        except (shm_errors.LayoutMismatch, shm_errors.CapacityError) as exc:
            raise LayoutMismatch(str(exc)) from exc
        buffer = self._engine.open(req.buffer, layout)
        with self._lock:
            iid = instance_id if instance_id is not None else self._next_id
            self._next_id = max(self._next_id, iid + 1)
            inst = Instance(iid, req, layout, class_id, buffer)
            inst.thread = threading.Thread(target=inst._work, name=f"instance-{iid}", daemon=True)
            self._by_id[iid] = inst
            self._save()
        inst.thread.start()
        log.info("registered instance %d (%s, ws=%d, worker=%s, layout=%s) request_id=%s", iid,
                 req.model_name, req.world_size, req.worker_id, layout.shape, req.request_id)
        return inst

    def _check_namespace_layout(self, cc: ChunkClass) -> None:
        for c in range(self._store.config.max_classes):
            try:
                other = self._store.chunk_class(c)
            except KeyError:
                continue
            if other.model_name == cc.model_name and other.world_size == cc.world_size and \
                    other.chunk_size == cc.chunk_size and other != cc:
                raise LayoutMismatch(
                    f"model {cc.model_name!r} (world_size {cc.world_size}) is stored with "
                    f"L={other.num_layers}, D={other.hidden_dim}, {other.dtype}; this buffer has "
                    f"L={cc.num_layers}, D={cc.hidden_dim}, {cc.dtype}")

    def remove(self, inst: Instance) -> None:
        """Drop ``inst`` from the table and close its buffer (on its own worker thread)."""
        with self._lock:
            self._by_id.pop(inst.id, None)
            self._save()
        inst.buffer.close()
        log.info("unregistered instance %d", inst.id)

    def get(self, instance_id: int) -> Instance:
        with self._lock:
            inst = self._by_id.get(instance_id)
        if inst is None:
            raise UnknownInstance(f"no instance {instance_id}")
        return inst

    def all(self) -> list[Instance]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda i: i.id)

    # -- persistence ------------------------------------------------------------------------

    def _save(self) -> None:
        saved = [Saved(i.id, i.request) for i in self._by_id.values()]
        tmp = f"{self._path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode({"next_id": self._next_id, "instances": saved}))
        os.replace(tmp, self._path)

    def restore(self) -> list[int]:
        """Re-open the instances a previous data plane saved; returns their ids."""
        try:
            with open(self._path, "rb") as f:
                raw: dict[str, Any] = msgspec.json.decode(f.read())
        except (FileNotFoundError, msgspec.DecodeError):
            return []
        self._next_id = max(self._next_id, int(raw.get("next_id", 1)))
        back = []
        for item in msgspec.convert(raw.get("instances", []), list[Saved]):
            if item.request.owner_pid is not None and not pid_alive(item.request.owner_pid):
                release_buffer(item.request)
                continue
            try:
                self.register(item.request, item.instance_id)
                back.append(item.instance_id)
            except Exception as exc:
                log.warning("could not re-open instance %d: %s", item.instance_id, exc)
        with self._lock:
            self._save()
        return back

    def orphans(self) -> list[Instance]:
        """Instances whose owner process has died."""
        return [i for i in self.all()
                if i.request.owner_pid is not None and not pid_alive(i.request.owner_pid)]


def release_buffer(req: RegisterInstance) -> None:
    """Unlink a dead owner's shm buffer (nobody else will)."""
    if isinstance(req.buffer, ShmBuffer):
        unlink_segment(req.buffer.name)


def _layout_of(req: RegisterInstance) -> KVLayout:
    try:
        if req.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {req.world_size}")
        if req.worker_id is not None and not 0 <= req.worker_id < req.world_size:
            raise ValueError(f"worker_id {req.worker_id} outside [0, {req.world_size})")
        if not req.model_name:
            raise ValueError("model_name must not be empty")
        return KVLayout(req.num_layers, req.num_tokens, req.hidden_dim, DType.parse(req.dtype))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


__all__ = ["Instance", "Registry", "state_path", "release_buffer"]
