"""Typed messages between clients and the data plane: one tagged union each way.

This module owns the wire types and their framing; it does not own the socket (``dataplane.channel``)
or what the data plane does with a request (``dataplane.server``).

Frame on the stream socket::

    offset  bytes  field
    0       4      payload length, uint32 little-endian
    4       8      call id, uint64 little-endian (a reply carries its request's call id)
    12      n      payload: msgpack of one ``Request`` or ``Reply`` (tag field ``type``)

Token ids travel as little-endian uint32 bytes. Every request may carry a ``request_id`` that the
data plane puts in its events and logs.

Every frame is hostile until decoded: a frame longer than ``MAX_FRAME`` closes the connection
before its payload is read, and the decoder enforces each field's bounds (``msgspec.Meta`` below)
before any side effect. Calls on an instance carry its ``token`` (the capability registration
answered); docs/security.md has the model and the limits.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Literal

import msgspec

from kvblend.dataplane.backends import Backend
from kvblend.shm.hashing import CACHE_SALT_BYTES, MODEL_NAME_BYTES

HEADER = struct.Struct("<IQ")
MAX_CALL_TOKENS = 1 << 20           # token ids in one store or retrieve call
MAX_MATCHES = 16384                 # matches in one retrieve
MAX_FRAME = 8 << 20                 # holds either bound with room to spare
MAX_LAYER_GROUPS = 1024             # groups of a layer-wise retrieve
MAX_PAGED_LAYERS = 1024             # layers of a paged registration
MAX_PAGED_BUFFERS = 1024            # buffers a paged registration names
MAX_LAYER_GROUP_MATCHES = 512       # matches (chunks) of a layer-wise retrieve (store): all
                                    # pinned (reserved) at once
MAX_LAYER_WAIT_S = 300.0            # a layer-wise store's wait for each group's announcement
TOKEN_HEX = 32                      # an instance token: 128 random bits, lowercase hex

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
Label = Annotated[str, msgspec.Meta(max_length=max(MODEL_NAME_BYTES, CACHE_SALT_BYTES))]
RequestId = Annotated[str, msgspec.Meta(max_length=128)] | None
InstanceToken = Annotated[str, msgspec.Meta(max_length=TOKEN_HEX)]
TokenBytes = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_CALL_TOKENS)]
IpcHandle = Annotated[bytes, msgspec.Meta(max_length=64)]
EventHandle = IpcHandle | None


class WireDType(enum.StrEnum):
    """A KV buffer's element type on the wire (``shm.layout.DType`` by name)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class BufferKind(enum.StrEnum):
    """How an instance's buffer is shared: the tag of its ``BufferSpec``."""

    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    PAGED = "paged"


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
    STORE_FULL = "store_full"
    CAPACITY = "capacity"
    BUSY = "busy"
    BACKEND = "backend"
    LAYERS_NOT_WRITTEN = "layers_not_written"
    INTERNAL = "internal"


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, frozen=True):
    pass


# -- buffer specs -------------------------------------------------------------------------------

class ShmBuffer(_Msg, tag="shm"):
    """A CPU buffer: a POSIX shared-memory segment ``<prefix>_kvbuf_<32 hex>`` that the engine
    created and owns, holding ``[2, L, T, D]`` from byte 0."""

    name: Annotated[str, msgspec.Meta(max_length=255)]


class CudaIpcBuffer(_Msg, tag="cuda_ipc"):
    """A CUDA buffer shared by ``cudaIpcGetMemHandle``.

    Attributes:
        handle: the 64-byte IPC memory handle of the allocation holding the buffer.
        offset: bytes from the allocation's base to the buffer's first element.
        device_uuid: the GPU's UUID (hex, with or without ``GPU-`` and dashes), not its index.
    """

    handle: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
    offset: U63
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)]


class KVPlacement(msgspec.Struct, array_like=True, frozen=True):
    """Where K (or V) sits in one layer of a paged cache, in elements of the dtype: element
    (block b, slot s, head h, dim d) is at ``offset + b*block + s*token + h*head + d*dim``."""

    offset: U63
    block: U63
    token: U63
    head: U63
    dim: U63


class PagedLayer(msgspec.Struct, array_like=True, frozen=True):
    """Layer l of a paged cache: ``buffers[buffer]`` from byte ``offset``."""

    buffer: Count
    offset: U63


class PagedBuffer(_Msg, tag="paged"):
    """An engine's paged KV cache: per-layer tensors in one or more shared buffers, described by
    ``dataplane.paged`` (the layout table there). Its blocks hold ``block_size`` tokens each;
    calls name them by a block table.

    Attributes:
        layer_bytes: bytes of one layer from its offset; every element K and V address lies in it.
    """

    block_size: Count
    num_blocks: Count
    kv_heads: Count
    head_dim: Count
    k: KVPlacement
    v: KVPlacement
    layer_bytes: U63
    buffers: Annotated[list[ShmBuffer | CudaIpcBuffer],
                       msgspec.Meta(max_length=MAX_PAGED_BUFFERS)]
    layers: Annotated[list[PagedLayer], msgspec.Meta(max_length=MAX_PAGED_LAYERS)]


BufferSpec = ShmBuffer | CudaIpcBuffer | PagedBuffer
BlockTableBytes = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_CALL_TOKENS)] | None


class MatchSpec(msgspec.Struct, array_like=True, frozen=True):
    """One lookup match: the chunk was computed at ``[old_st, old_ed)``, sits at ``[cur_st, cur_ed)``."""

    old_st: U63
    old_ed: U63
    cur_st: U63
    cur_ed: U63
    chunk_hash: Annotated[bytes, msgspec.Meta(max_length=64)]


# -- requests -----------------------------------------------------------------------------------

class Ping(_Msg):
    request_id: RequestId = None


MAX_HEAD_DIM = 1024
MAX_POSITION = 1 << 24  # positions a rotation takes (float32 holds every integer below 2^24)

Positive = Annotated[float, msgspec.Meta(gt=0)]


class RotaryConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a model rotates K by position (``dataplane.rotary`` has the formulas and the check).

    Attributes:
        head_dim: dims of one head.
        rotary_dim: dims of each head that rotate (partial rotary); 0 means all of ``head_dim``.
        theta: the base of the frequencies (``rope_theta``).
        style: ``neox`` (half split, Llama, Mistral, Qwen) or ``gptj`` (interleaved pairs).
        scaling: ``none``, ``linear``, ``llama3`` or ``yarn``.
        factor: the scaling factor (linear, llama3, yarn).
        low_freq_factor, high_freq_factor: llama3's bounds.
        original_max_position_embeddings: the pre-training context (llama3, yarn).
        beta_fast, beta_slow, truncate: yarn's ramp.
        inv_freq: the engine's own frequencies, ``rotary_dim / 2`` of them; replaces theta and
            scaling when given.
    """

    head_dim: Annotated[int, msgspec.Meta(ge=2, le=MAX_HEAD_DIM)]
    rotary_dim: Annotated[int, msgspec.Meta(ge=0, le=MAX_HEAD_DIM)] = 0
    theta: Positive = 10000.0
    style: Literal["neox", "gptj"] = "neox"
    scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: Positive = 1.0
    low_freq_factor: Positive = 1.0
    high_freq_factor: Positive = 4.0
    original_max_position_embeddings: Annotated[int, msgspec.Meta(ge=1)] = 8192
    beta_fast: Positive = 32.0
    beta_slow: Positive = 1.0
    truncate: bool = True
    inv_freq: Annotated[list[float], msgspec.Meta(max_length=MAX_HEAD_DIM // 2)] | None = None

    @property
    def dim(self) -> int:
        """The dims that rotate."""
        return self.rotary_dim or self.head_dim


class RegisterInstance(_Msg):
    """Register an engine worker's KV buffer ``[2, num_layers, num_tokens, hidden_dim]``; the
    instance lives while its lease is renewed (``RenewLease`` or any call with its token).
    ``rotary``: the model's rotary config; its retrieves then turn K to the prompt's positions."""

    model_name: Label
    world_size: Count
    worker_id: Count | None
    num_layers: Count
    num_tokens: Count
    hidden_dim: Count
    dtype: WireDType
    buffer: BufferSpec
    rotary: RotaryConfig | None = None
    request_id: RequestId = None


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
    done_event: EventHandle = None
    token: InstanceToken = ""
    request_id: RequestId = None


class RetrieveChunks(_Msg):
    """Copy each match's chunk into ``buffer[:, :, offset+cur_st:offset+cur_ed, :]`` (a paged
    buffer: into the slots its ``block_table`` gives those positions).

    ``layer_groups`` > 0 asks for a layer-wise retrieve: the layers are copied in that many
    groups in order (at most ``MAX_LAYER_GROUP_MATCHES`` matches), and a ``LayersReady`` frame
    with the call's id announces each group before the final ``TransferDone``: on a CPU buffer
    once its copies completed, on a CUDA buffer once ``layer_events[g]`` (one interprocess event
    per group) was recorded after them on the instance's stream.

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
    matches: Annotated[list[MatchSpec], msgspec.Meta(max_length=MAX_MATCHES)]
    offset: U63 = 0
    block_table: BlockTableBytes = None
    layer_groups: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_GROUPS)] = 0
    layer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=MAX_LAYER_GROUPS)] = []
    first_position: Annotated[int, msgspec.Meta(ge=0, lt=MAX_POSITION)] = 0
    rotate: bool = True
    cache_salt: Label = ""
    event: EventHandle = None
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
    matches: Annotated[list[MatchSpec], msgspec.Meta(max_length=MAX_MATCHES)]
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
    will not be copied, known before the first."""

    instance_id: int
    layers: int
    failed: list[int] = []


Reply = (Pong | Registered | LeaseRenewed | Unregistered | InstanceList | TransferDone
         | LayersReady | Prefetching | ErrorReply)

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def frame(call_id: int, msg: _Msg) -> bytes:
    """Header and payload of one message, ready for ``sendall``."""
    payload = _encoder.encode(msg)
    return HEADER.pack(len(payload), call_id) + payload


__all__ = ["Backend", "StoreKind", "ErrorKind", "ShmBuffer", "CudaIpcBuffer", "BufferSpec",
           "MatchSpec", "Ping", "RegisterInstance", "UnregisterInstance", "RenewLease",
           "ListInstances", "LeaseRenewed", "MAX_CALL_TOKENS", "MAX_MATCHES", "TOKEN_HEX",
           "StoreChunks", "RetrieveChunks", "LayersWritten", "PrefetchChunks", "Prefetching",
           "RotaryConfig", "Request", "Pong", "InstanceInfo", "Registered",
           "Unregistered", "InstanceList", "TransferDone", "ErrorReply", "Reply", "frame",
           "request_decoder", "reply_decoder", "HEADER", "MAX_FRAME"]
