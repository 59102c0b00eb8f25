"""The API's link to the data plane: its public messages over its channel, nothing more.

Instances live in the data-plane process (it owns the engines' buffers), so the instance routes
forward to it. A data plane that does not answer makes ``ping`` return None (readiness, status) and
every other call raise ``dataplane.errors.DataPlaneUnavailable`` (a 503 at the edge).
"""

from __future__ import annotations

import base64

from api.errors import register_error
from api.schemas import Instance, InstanceCreated, KVLayoutOut, RegisterInstance
from dataplane import errors as dp_errors
from dataplane import messages as dp
from dataplane.channel import Channel
from shm.layout import KVLayout

for _exc, _status in ((dp_errors.RemoteError, 500), (dp_errors.UnknownInstance, 404),
                      (dp_errors.Forbidden, 403), (dp_errors.TooMany, 429),
                      (dp_errors.BadRequest, 422), (dp_errors.OutOfRange, 422),
                      (dp_errors.LayoutMismatch, 409), (dp_errors.StoreFull, 507),
                      (dp_errors.BackendError, 500), (dp_errors.DataPlaneUnavailable, 503),
                      (dp_errors.Timeout, 504)):
    register_error(_exc, _status)


class DataPlaneLink:
    """Typed calls to the data plane at ``address``.

    Args:
        address: the data plane's channel address.
        timeout: seconds any call may take (control calls are quick; copies never go this way).
        ping_timeout: seconds a readiness ping may take.
    """

    def __init__(self, address: str, timeout: float = 10.0, ping_timeout: float = 1.0) -> None:
        self.address = address
        self._timeout, self._ping_timeout = timeout, ping_timeout
        self._channel = Channel(address, connect_timeout=ping_timeout)

    def ping(self) -> dp.Pong | None:
        """The data plane's pong, or None when it does not answer."""
        try:
            pong: dp.Pong = self._channel.call(dp.Ping(), self._ping_timeout)
        except dp_errors.DataPlaneError:
            return None
        return pong

    def register(self, body: RegisterInstance, request_id: str | None = None) -> InstanceCreated:
        """Register an engine buffer; returns its id, token and lease.

        Raises:
            BadRequest: the buffer cannot be opened, is not the client's, or its description is
                wrong.
            LayoutMismatch: the layout disagrees with what the namespace already stores.
            TooMany: the data plane's instance limits are reached.
        """
        buffer: dp.BufferSpec
        if body.shm_name is not None:
            buffer = dp.ShmBuffer(name=body.shm_name)
        else:
            assert body.cuda_ipc is not None, "RegisterInstance validation admits one buffer"
            ipc = body.cuda_ipc
            buffer = dp.CudaIpcBuffer(handle=base64.b64decode(ipc.handle), offset=ipc.offset,
                                      device_uuid=ipc.device_uuid)
        msg = dp.RegisterInstance(
            model_name=body.model_name, world_size=body.world_size, worker_id=body.worker_id,
            num_layers=body.num_layers, num_tokens=body.num_tokens, hidden_dim=body.hidden_dim,
            dtype=body.dtype, buffer=buffer, request_id=request_id)
        reply: dp.Registered = self._channel.call(msg, self._timeout)
        return InstanceCreated(instance_id=reply.instance_id, instance_token=reply.token,
                               lease_s=reply.lease_s)

    def unregister(self, instance_id: int, token: str, request_id: str | None = None) -> None:
        """Raises: UnknownInstance, Forbidden (a wrong or missing token)."""
        self._channel.call(dp.UnregisterInstance(instance_id=instance_id, token=token,
                                                 request_id=request_id), self._timeout)

    def list_instances(self) -> list[Instance]:
        reply: dp.InstanceList = self._channel.call(dp.ListInstances(), self._timeout)
        return [_instance(i) for i in reply.instances]

    def get_instance(self, instance_id: int) -> Instance:
        """Raises: UnknownInstance."""
        for inst in self.list_instances():
            if inst.instance_id == instance_id:
                return inst
        raise dp_errors.UnknownInstance(f"no instance {instance_id}")

    def close(self) -> None:
        self._channel.close()


def _instance(info: dp.InstanceInfo) -> Instance:
    layout = KVLayout(info.num_layers, info.num_tokens, info.hidden_dim, info.dtype)
    return Instance(
        instance_id=info.instance_id, model_name=info.model_name, world_size=info.world_size,
        worker_id=info.worker_id,
        kv_layout=KVLayoutOut(num_layers=layout.num_layers, num_tokens=layout.num_tokens,
                              hidden_dim=layout.hidden_dim, dtype=str(layout.dtype),
                              bytes_per_token=layout.bytes_per_token))
