"""``/v1/instances``: engine KV buffers registered with the data plane."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Request, Response

from kvblend.api.auth import require_token
from kvblend.api.deps import DataPlaneDep
from kvblend.api.errors import responses
from kvblend.api.lookup import request_id_of
from kvblend.api.schemas import Instance, InstanceCreated, InstanceList, RegisterInstance
from kvblend.dataplane.messages import TOKEN_HEX

router = APIRouter(prefix="/v1/instances", tags=["instances"],
                   dependencies=[Depends(require_token)])

InstanceId = Annotated[int, Path(ge=0, le=2**63 - 1, description="As returned by registration.")]
InstanceToken = Annotated[str, Header(alias="X-Instance-Token", max_length=TOKEN_HEX,
                                      description="The token registration returned.")]


@router.post("", status_code=201, response_model=InstanceCreated, operation_id="registerInstance",
             summary="Register an engine worker's KV buffer",
             description="The data plane opens the buffer (a POSIX shm object the engine "
                         "created under `<shm_prefix>_kvbuf_<32 hex>`, or a CUDA IPC handle) "
                         "and serves store and retrieve calls for it from then on. The answer "
                         "holds the instance token every later call on it needs.",
             responses=responses(401, 409, 413, 422, 429, 503))
def register_instance(body: RegisterInstance, request: Request, dataplane: DataPlaneDep
                      ) -> InstanceCreated:
    return dataplane.register(body, request_id_of(request))


@router.get("", response_model=InstanceList, operation_id="listInstances",
            summary="Registered instances", responses=responses(401, 503))
def list_instances(dataplane: DataPlaneDep) -> InstanceList:
    return InstanceList(instances=dataplane.list_instances())


@router.get("/{instance_id}", response_model=Instance, operation_id="getInstance",
            summary="One registered instance", responses=responses(401, 404, 422, 503))
def get_instance(instance_id: InstanceId, dataplane: DataPlaneDep) -> Instance:
    return dataplane.get_instance(instance_id)


@router.delete("/{instance_id}", status_code=204, response_class=Response,
               operation_id="unregisterInstance", summary="Unregister an instance",
               description="Needs the instance's token in `X-Instance-Token`.",
               responses=responses(401, 403, 404, 422, 503))
def unregister_instance(instance_id: InstanceId, token: InstanceToken, request: Request,
                        dataplane: DataPlaneDep) -> Response:
    dataplane.unregister(instance_id, token, request_id_of(request))
    return Response(status_code=204)
