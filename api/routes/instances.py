"""``/v1/instances``: engine KV buffers registered with the data plane.

The registration body is the data plane's own type (``dataplane.registration.Registration``, the
payload of its ``RegisterInstance`` frame): this route decodes it with msgspec, which checks every
bound before the data plane is asked, and passes it on as it is. Its OpenAPI schema is the type's
JSON Schema (``SCHEMAS``, merged into the document by ``api.app``). Each registration goes with
its caller's key (``api.callers``), by which the data plane bounds what one caller, and the HTTP
path as a whole, may register (``dataplane.instances``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Header, Path, Request, Response

from kvblend.api.auth import require_token
from kvblend.api.callers import caller_of
from kvblend.api.deps import DataPlaneDep
from kvblend.api.errors import InvalidInput, responses
from kvblend.api.lookup import request_id_of
from kvblend.api.schemas import Instance, InstanceCreated, InstanceList
from kvblend.dataplane.messages import TOKEN_HEX
from kvblend.dataplane.registration import Registration

router = APIRouter(prefix="/v1/instances", tags=["instances"],
                   dependencies=[Depends(require_token)])

InstanceId = Annotated[int, Path(ge=0, le=2**63 - 1, description="As returned by registration.")]
InstanceToken = Annotated[str, Header(alias="X-Instance-Token", max_length=TOKEN_HEX,
                                      description="The token registration returned.")]

EXAMPLE = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "world_size": 1, "worker_id": 0,
           "num_layers": 32, "num_tokens": 32768, "hidden_dim": 1024, "dtype": "bfloat16",
           "buffer": {"type": "shm", "name": "kvblend_kvbuf_5f3c2d1e8a9b4c7d9e0f1a2b3c4d5e6f"}}
# the body's schema, and the components it names (the document's ``components.schemas``)
(BODY_SCHEMA,), SCHEMAS = msgspec.json.schema_components(
    [Annotated[Registration, msgspec.Meta(examples=[EXAMPLE])]],
    ref_template="#/components/schemas/{name}")
BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": BODY_SCHEMA}}}}
_decode = msgspec.json.Decoder(Registration).decode


async def read_registration(request: Request) -> Registration:
    """The body as a ``Registration``, every bound checked.

    Raises:
        msgspec.DecodeError: not JSON, or not a registration (a 422 naming the field).
        InvalidInput: a body in another content type than JSON.
    """
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise InvalidInput(f"a registration is JSON, not {ctype!r}")
    return _decode(await request.body())


RegistrationBody = Annotated[Registration, Depends(read_registration)]


@router.post("", status_code=201, response_model=InstanceCreated, operation_id="registerInstance",
             summary="Register an engine worker's KV buffer",
             description="The data plane opens the buffer (a POSIX shm object the engine "
                         "created under `<shm_prefix>_kvbuf_<32 hex>`, or a CUDA IPC handle) "
                         "and serves store and retrieve calls for it from then on. The answer "
                         "holds the instance token every later call on it needs. One caller "
                         "(one token, else one peer) may hold `--max-instances-per-client` "
                         "instances, the HTTP path as a whole all but a quarter of "
                         "`--max-instances` (429); a buffer that a live instance of another "
                         "caller holds is refused (409 `buffer_in_use`).",
             responses=responses(401, 409, 413, 422, 429, 503), openapi_extra=BODY)
def register_instance(body: RegistrationBody, request: Request, dataplane: DataPlaneDep
                      ) -> InstanceCreated:
    return dataplane.register(body, request_id_of(request), caller_of(request.scope))


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
