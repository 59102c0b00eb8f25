"""Typed messages between clients and the data plane: one tagged union each way.

This module owns the wire types and their framing; it does not own the socket (``dataplane.channel``)
or what the data plane does with a request (``dataplane.server``). The registration's types are
declared in ``dataplane.registration`` (they are also the HTTP body of ``POST /v1/instances``);
``RegisterInstance`` carries one, and this module re-exports them.

Frame on the stream socket::

    offset  bytes  field
    0       4      payload length, uint32 little-endian
    4       8      call id, uint64 little-endian (a reply carries its request's call id)
    12      n      payload: msgpack of one ``Request`` or ``Reply`` (tag field ``type``)

Token ids travel as little-endian uint32 bytes. Every request may carry a ``request_id`` that the
data plane puts in its events and logs.

Every frame is hostile until decoded: a frame longer than ``MAX_FRAME`` closes the connection
before its payload is read, and the decoder enforces each field's bounds (``msgspec.Meta`` below
and in ``dataplane.registration``) before any side effect. Calls on an instance carry its
``token`` (the capability registration answered); docs/security.md has the model and the limits.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated

import msgspec

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.registration import (MAX_HEAD_DIM, MAX_PAGED_BUFFERS, MAX_PAGED_LAYERS,
                                            MAX_POSITION,
                                            BufferKind, BufferSpec, CudaIpcBuffer, KVPlacement,
                                            PagedBuffer, PagedLayer, Registration, RotaryConfig,
                                            ShmBuffer, WireDType)
from kvblend.shm.hashing import CACHE_SALT_BYTES, MODEL_NAME_BYTES

HEADER = struct.Struct("<IQ")
MAX_CALL_TOKENS = 1 << 20           # token ids in one store or retrieve call
MAX_MATCHES = 16384                 # matches in one retrieve
MAX_FRAME = 8 << 20                 # holds either bound with room to spare
MAX_LAYER_GROUPS = 1024             # groups of a layer-wise retrieve
MAX_LAYER_GROUP_MATCHES = 512       # matches (chunks) of a layer-wise retrieve (store): all
                                    # pinned (reserved) at once
MAX_LAYER_WAIT_S = 300.0            # a layer-wise store's wait for each group's announcement
TOKEN_HEX = 32                      # an instance token: 128 random bits, lowercase hex

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Label = Annotated[str, msgspec.Meta(max_length=max(MODEL_NAME_BYTES, CACHE_SALT_BYTES))]
RequestId = Annotated[str, msgspec.Meta(max_length=128)] | None
InstanceToken = Annotated[str, msgspec.Meta(max_length=TOKEN_HEX)]
TokenBytes = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_CALL_TOKENS)]
IpcHandle = Annotated[bytes, msgspec.Meta(max_length=64)]
EventHandle = IpcHandle | None
# a count of the instance's order word (``dataplane.streamword``) that the copies wait for
OrderCount = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)] | None
# who an HTTP registration is for (``api.callers``): a key, never a secret
Caller = Annotated[str, msgspec.Meta(min_length=1, max_length=80,
                                     pattern=r"^(token|uid|addr):[0-9A-Za-z._:%\[\]-]+$")] | None


class StoreKind(str, enum.Enum):
    PRE_COMPUTED = "pre_computed"  # a document computed on its own, positions from 0
    FINAL = "final"                # a whole blended request, for later reuse


class ChunkFailure(enum.StrEnum):
    """Why one chunk of a store or retrieve was not done."""

    MISSING = "missing"                  # retrieve: not stored, or evicted since the lookup
    PINS_FULL = "pins_full"              # retrieve: the pin table was full (too many readers)
    LAYOUT_MISMATCH = "layout_mismatch"  # retrieve: stored by an instance of another layout
    TOKENS_MISMATCH = "tokens_mismatch"  # retrieve: the chunk holds other tokens than the
                                         # prompt at cur_st (a wrong match)
    MOVED = "moved"                      # retrieve with rotate=False: the chunk is stored at
                                         # another position than its match's old_st
    NO_ROOM = "no_room"                  # store: every slot the chunk fits was pinned or
                                         # being written


class ErrorKind(str, enum.Enum):
    UNKNOWN_INSTANCE = "unknown_instance"
    FORBIDDEN = "forbidden"
    TOO_MANY = "too_many"
    BAD_REQUEST = "bad_request"
    OUT_OF_RANGE = "out_of_range"
    LAYOUT_MISMATCH = "layout_mismatch"
    BUFFER_IN_USE = "buffer_in_use"
    STORE_FULL = "store_full"
    CAPACITY = "capacity"
    BUSY = "busy"
    BACKEND = "backend"
    LAYERS_NOT_WRITTEN = "layers_not_written"
    INTERNAL = "internal"


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, frozen=True):
    pass


BlockTableBytes = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_CALL_TOKENS)] | None


# a match on the wire (``dataplane.client_transfer.match_bytes``): little-endian int64 old_st,
# old_ed, cur_st, cur_ed and the chunk hash's 16 bytes as two words
MATCH_WORDS = 6
MATCH_BYTES = 8 * MATCH_WORDS
MatchBytes = Annotated[bytes, msgspec.Meta(max_length=MAX_MATCHES * MATCH_BYTES)]
"""Lookup matches, packed: row j says the chunk was computed at ``[old_st, old_ed)`` and sits
at ``[cur_st, cur_ed)`` of the call's tokens (one array, not an object per match)."""


# -- requests -----------------------------------------------------------------------------------

class Ping(_Msg):
    request_id: RequestId = None


class RegisterInstance(_Msg):
    """Register an engine worker's KV cache: ``registration`` is the body of ``POST
    /v1/instances`` as it is (``dataplane.registration``, the one contract of both); the instance
    lives while its lease is renewed (``RenewLease`` or any call with its token).

    ``caller`` is set by the API alone: the HTTP caller it registers for (``api.callers``). Such
    a registration counts against its caller's share and the HTTP path's, never the slots kept
    for engines on the socket, and cannot name a buffer another caller's live instance holds
    (``dataplane.instances``). None: the connection registers for itself."""

    registration: Registration
    request_id: RequestId = None
    caller: Caller = None


class UnregisterInstance(_Msg):
    instance_id: U63
    token: InstanceToken = ""
    request_id: RequestId = None


class RenewLease(_Msg):
    """Keep an instance alive for another lease."""

    instance_id: U63
    token: InstanceToken = ""
    request_id: RequestId = None


class ListInstances(_Msg):
    request_id: RequestId = None


class StoreChunks(_Msg):
    """Store every full chunk of ``token_ids`` from ``buffer[:, :, offset:offset+len, :]``.

    ``event``: the engine's interprocess CUDA event handle, waited on before the copy.
    ``order``: a count of the instance's order word (``Registration.order_word``) that the copy
    waits for too (``dataplane.streamword``); refused for an instance without one.
    ``done_event``: an interprocess CUDA event handle the data plane records after the copy.
    ``block_table``: a paged buffer's block ids (little-endian int32) for the call's logical
    positions ``[0, offset + len)``; required for a paged buffer, refused for another.

    ``layer_groups`` > 0 asks for a layer-wise store: the engine is still writing the layers and
    announces them with ``LayersWritten`` frames naming this call; the data plane copies each group
    of layers once announced (on a CUDA buffer after ``layer_events[g]``, one interprocess event
    per group that the engine records before it announces the group) and fails the call when a
    group is not announced within ``layer_wait_s`` (at most ``MAX_LAYER_GROUP_MATCHES`` chunks).

    ``first_position``: the model's position of ``token_ids[0]`` when its KV was computed (a
    document prefilled behind a BOS token starts at 1); each chunk keeps its own, and retrieves
    turn K from there.
    """

    instance_id: U63
    token_ids: TokenBytes
    offset: U63 = 0
    block_table: BlockTableBytes = None
    layer_groups: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_GROUPS)] = 0
    layer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=MAX_LAYER_GROUPS)] = []
    layer_wait_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LAYER_WAIT_S)] = 30.0
    first_position: Annotated[int, msgspec.Meta(ge=0, lt=MAX_POSITION)] = 0
    kind: StoreKind = StoreKind.PRE_COMPUTED
    cache_salt: Label = ""
    event: EventHandle = None
    order: OrderCount = None
    done_event: EventHandle = None
    token: InstanceToken = ""
    request_id: RequestId = None


class RetrieveChunks(_Msg):
    """Copy each match's chunk into ``buffer[:, :, offset+cur_st:offset+cur_ed, :]`` (a paged
    buffer: into the slots its ``block_table`` gives those positions).

    ``layer_groups`` > 0 asks for a layer-wise retrieve: the layers are copied in that many
    groups in order (at most ``MAX_LAYER_GROUP_MATCHES`` matches), and a ``LayersReady`` frame
    with the call's id announces each group before the final ``TransferDone``: on a CPU buffer
    once its copies completed; on a CUDA buffer once ``layer_events[g]`` (one interprocess event
    per group) was recorded after them on the instance's stream, or, without layer events, once
    that stream was made to write the frame's count of the instance's ready word after them
    (``LayersReady.ready``), or else once they completed. ``event`` and ``order`` order the
    copies after the engine's work as a store's do.

    On an instance registered with a rotary config, K of each copied chunk is turned from the
    positions it was computed at (its store's ``first_position`` plus the chunk's place there) to
    the prompt's (this call's ``first_position``, the model's position of the prompt's token 0,
    plus ``cur_st``) unless ``rotate`` is False; a layer-wise retrieve announces a group once its
    layers are turned. With ``rotate`` False (the engine turns K itself, from each match's
    ``old_st``), a chunk now stored from another position than its match's ``old_st`` is not
    copied (``ChunkFailure.MOVED``).
    """

    instance_id: U63
    token_ids: TokenBytes
    matches: MatchBytes
    offset: U63 = 0
    block_table: BlockTableBytes = None
    layer_groups: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_GROUPS)] = 0
    layer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=MAX_LAYER_GROUPS)] = []
    first_position: Annotated[int, msgspec.Meta(ge=0, lt=MAX_POSITION)] = 0
    rotate: bool = True
    cache_salt: Label = ""
    event: EventHandle = None
    order: OrderCount = None
    done_event: EventHandle = None
    token: InstanceToken = ""
    request_id: RequestId = None


class PrefetchChunks(_Msg):
    """Start fetching the remote chunks among ``matches`` (a lookup's, whose ``location`` is
    ``remote``) into the local store, and answer at once (``Prefetching``); a later
    ``RetrieveChunks`` of them waits for those fetches and finds the chunks local. Matches
    already local, or not known to the remote tier, are left alone."""

    instance_id: U63
    token_ids: TokenBytes
    matches: MatchBytes
    cache_salt: Label = ""
    token: InstanceToken = ""
    request_id: RequestId = None


class LayersWritten(_Msg):
    """Layers ``[0, layers)`` of the layer-wise store sent as ``call`` (the call id of its frame,
    on this connection) are in the engine's buffer (CUDA: the group's event is recorded). No
    reply: a frame that names no such store of this instance in flight is dropped."""

    instance_id: U63
    call: U63
    layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGED_LAYERS)]
    token: InstanceToken = ""


Request = (Ping | RegisterInstance | UnregisterInstance | RenewLease | ListInstances | StoreChunks
           | RetrieveChunks | LayersWritten | PrefetchChunks)


# -- replies ------------------------------------------------------------------------------------

class Pong(_Msg):
    pid: int
    backend: Backend
    version: str
    chunk_size: int
    shm_prefix: str


class InstanceInfo(_Msg):
    instance_id: int
    model_name: str
    world_size: int
    worker_id: int | None
    num_layers: int
    num_tokens: int
    hidden_dim: int
    dtype: WireDType
    buffer_kind: BufferKind


class Registered(_Msg):
    """``token`` is the instance's capability: every later call on it must carry it."""

    instance_id: int
    token: str
    lease_s: float


class LeaseRenewed(_Msg):
    instance_id: int
    lease_s: float


class Unregistered(_Msg):
    instance_id: int


class InstanceList(_Msg):
    instances: list[InstanceInfo]


class TransferDone(_Msg):
    """A store or retrieve that ran to its end.

    Attributes:
        num_chunks: chunks the call covered (full chunks of a store; matches of a retrieve).
        copied: chunks actually copied (a store skips chunks already stored).
        failed: indexes (chunk index of a store; match index of a retrieve) that were not done.
        reasons: why, one per index of ``failed``.
        nbytes: bytes copied.
        not_indexed: chunk indexes of a store that are stored but that lookups will not find
            (the fingerprint index is full of live entries).
    """

    instance_id: int
    num_chunks: int
    copied: int
    failed: list[int]
    nbytes: int
    duration_s: float
    not_indexed: list[int] = []
    reasons: list[ChunkFailure] = []


class Prefetching(_Msg):
    """A ``PrefetchChunks`` was taken: ``started`` chunks are being fetched."""

    instance_id: int
    started: int


class ErrorReply(_Msg):
    kind: ErrorKind
    message: str


class LayersReady(_Msg):
    """Progress of a store or retrieve, before its ``TransferDone``: the copies of layers
    ``[0, layers)`` are done (CPU) or queued with their event recorded (CUDA: the group's layer
    event, or with every layer the call's ``done_event``). A layer-wise retrieve sends one per
    group; any other store or retrieve one with every layer, once all its copies are queued
    (before it commits or unpins). ``failed``: the chunk (store) or match (retrieve) indexes that
    will not be copied, known before the first. ``ready``: the count of the instance's ready
    word (``Registration.ready_word``) that the data plane's stream writes after the group's
    copies, where the group has no layer event."""

    instance_id: int
    layers: int
    failed: list[int] = []
    ready: OrderCount = None


Reply = (Pong | Registered | LeaseRenewed | Unregistered | InstanceList | TransferDone
         | LayersReady | Prefetching | ErrorReply)

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def frame(call_id: int, msg: _Msg) -> bytes:
    """Header and payload of one message, ready for ``sendall``."""
    payload = _encoder.encode(msg)
    return HEADER.pack(len(payload), call_id) + payload


__all__ = ["Backend", "StoreKind", "ErrorKind", "MATCH_WORDS", "MATCH_BYTES", "MatchBytes",
           "Ping", "RegisterInstance", "UnregisterInstance", "RenewLease", "ListInstances",
           "LeaseRenewed", "MAX_CALL_TOKENS",
           "MAX_MATCHES", "TOKEN_HEX", "StoreChunks", "RetrieveChunks", "LayersWritten",
           "PrefetchChunks", "Prefetching", "Request", "Pong", "InstanceInfo", "Registered",
           "Unregistered", "InstanceList", "TransferDone", "ErrorReply", "Reply", "frame",
           "request_decoder", "reply_decoder", "HEADER", "MAX_FRAME", "MAX_POSITION",
           # the registration's types (declared in dataplane.registration), part of the wire too
           "Registration", "BufferSpec", "ShmBuffer", "CudaIpcBuffer", "PagedBuffer",
           "KVPlacement", "PagedLayer", "RotaryConfig", "WireDType", "BufferKind",
           "MAX_PAGED_LAYERS", "MAX_PAGED_BUFFERS", "MAX_HEAD_DIM"]
