"""The API's link to the data plane: its public messages over its channel, nothing more.

Instances live in the data-plane process (it owns the engines' buffers), so the instance routes
forward to it. A data plane that does not answer makes ``ping`` return None (readiness, status) and
every other call raise ``dataplane.errors.DataPlaneUnavailable`` (a 503 at the edge).

A monitor thread pings the data plane every ``interval`` seconds; ``ping`` answers from its last
result without waiting, so readiness says 503 within about a second of the data plane hanging
(SIGSTOP, a stuck device), and calls fail at once while it is known not to answer instead of
holding a worker thread for their whole timeout.
"""

from __future__ import annotations

import threading
import time

from kvblend.api.schemas import Instance, InstanceCreated, KVLayoutOut
from kvblend.dataplane import errors as dp_errors
from kvblend.dataplane import messages as dp
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.registration import Registration
from kvblend.shm.layout import KVLayout

class DataPlaneLink:
    """Typed calls to the data plane at ``address``.

    Args:
        address: the data plane's channel address.
        timeout: seconds a registration may take (it opens and maps the engine's buffer).
        ping_timeout: seconds a ping may take; also how stale the last good ping may be.
        interval: seconds between the monitor's pings.
    """

    def __init__(self, address: str, timeout: float = 10.0, ping_timeout: float = 0.75,
                 interval: float = 0.25) -> None:
        self.address = address
        self._timeout, self._ping_timeout, self._interval = timeout, ping_timeout, interval
        self._channel = Channel(address, connect_timeout=ping_timeout)
        self._last: tuple[float, dp.Pong] | None = None  # (monotonic time, pong) of the last ok
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="dataplane-monitor",
                                         daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        while True:
            try:
                pong: dp.Pong = self._channel.call(dp.Ping(), self._ping_timeout)
                self._last = (time.monotonic(), pong)
            except dp_errors.DataPlaneUnavailable:  # gone (restarting): not ready from now
                self._last = None
            except dp_errors.DataPlaneError:  # slow: ready until the last pong is too old
                pass
            if self._stop.wait(self._interval):
                return

    def ping(self) -> dp.Pong | None:
        """The data plane's last pong when it answered within the last ``ping_timeout +
        interval`` seconds (answered without waiting), else None."""
        last = self._last
        if last is None or time.monotonic() - last[0] > self._ping_timeout + self._interval:
            return None
        return last[1]

    def _call(self, msg: object, timeout: float) -> object:
        if self.ping() is None:  # known not to answer: fail now, do not hold a worker thread
            raise dp_errors.DataPlaneUnavailable(f"the data plane at {self.address} does not "
                                                 "answer")
        try:
            return self._channel.call(msg, timeout)
        except dp_errors.DataPlaneUnavailable:
            self._last = None  # not ready until the monitor hears from it again
            raise

    def register(self, body: Registration, request_id: str | None = None,
                 caller: str | None = None) -> InstanceCreated:
        """Register an engine buffer (the body goes to the data plane as it is) for ``caller``
        (``api.callers``); returns its id, token and lease.

        Raises:
            BadRequest: the buffer cannot be opened, is not the client's, or its description is
                wrong.
            LayoutMismatch: the layout disagrees with what the namespace already stores.
            TooMany: the data plane's instance limits, or this caller's share, are reached.
            BufferInUse: a live instance of another caller holds the buffer.
        """
        reply = self._call(dp.RegisterInstance(registration=body, request_id=request_id,
                                               caller=caller), self._timeout)
        assert isinstance(reply, dp.Registered), "the channel raises on error replies"
        return InstanceCreated(instance_id=reply.instance_id, instance_token=reply.token,
                               lease_s=reply.lease_s)

    def unregister(self, instance_id: int, token: str, request_id: str | None = None) -> None:
        """Raises: UnknownInstance, Forbidden (a wrong or missing token)."""
        self._call(dp.UnregisterInstance(instance_id=instance_id, token=token,
                                         request_id=request_id), self._timeout)

    def list_instances(self) -> list[Instance]:
        reply = self._call(dp.ListInstances(), self._ping_timeout * 2)
        assert isinstance(reply, dp.InstanceList), "the channel raises on error replies"
        return [_instance(i) for i in reply.instances]

    def try_list_instances(self) -> list[Instance] | None:
        """The instances, or None when the data plane does not answer (status never fails)."""
        try:
            return self.list_instances()
        except (dp_errors.DataPlaneUnavailable, dp_errors.Timeout):
            return None

    def get_instance(self, instance_id: int) -> Instance:
        """Raises: UnknownInstance."""
        for inst in self.list_instances():
            if inst.instance_id == instance_id:
                return inst
        raise dp_errors.UnknownInstance(f"no instance {instance_id}")

    def close(self) -> None:
        self._stop.set()
        self._channel.close()
        self._monitor.join()


def _instance(info: dp.InstanceInfo) -> Instance:
    layout = KVLayout(info.num_layers, info.num_tokens, info.hidden_dim, info.dtype)
    return Instance(
        instance_id=info.instance_id, model_name=info.model_name, world_size=info.world_size,
        worker_id=info.worker_id,
        kv_layout=KVLayoutOut(num_layers=layout.num_layers, num_tokens=layout.num_tokens,
                              hidden_dim=layout.hidden_dim, dtype=str(layout.dtype),
                              bytes_per_token=layout.bytes_per_token))
