"""The registration contract: one set of types that is both the JSON body of ``POST /v1/instances``
and the payload of the data plane's ``RegisterInstance`` frame (msgpack).

This module owns the fields of a registration and their bounds, declared once: the API decodes
its body into ``Registration`` with msgspec, its OpenAPI schema is these types' JSON Schema
(``msgspec.json.schema_components``), and the data plane's request decoder checks the same bounds
on the frame. It does not own what the data plane does with a registration
(``dataplane.instances``) nor a paged layout's consistency (``dataplane.paged``).

JSON form (``bytes`` travel as base64 in JSON, raw in msgpack)::

    {"model_name": "m", "world_size": 1, "worker_id": 0,
     "num_layers": 32, "num_tokens": 32768, "hidden_dim": 1024, "dtype": "bfloat16",
     "buffer": {"type": "shm", "name": "<prefix>_kvbuf_<32 hex>"}
             | {"type": "cuda_ipc", "handle": "<base64, 64 bytes>", "offset": 0,
                "device_uuid": "GPU-..."}
             | {"type": "paged", "block_size": 16, "num_blocks": 2048, "kv_heads": 8,
                "head_dim": 128, "k": {placement}, "v": {placement}, "layer_bytes": ...,
                "buffers": [shm | cuda_ipc, ...], "layers": [{"buffer": 0, "offset": 0}, ...]},
     "rotary": null | {"head_dim": 128, "theta": 500000.0, "scaling": "llama3", ...}}

Every input is hostile until decoded: the decoder enforces each field's bounds (``msgspec.Meta``)
and refuses unknown fields, and ``Registration.__post_init__`` the labels' rules
(``shm.hashing.check_label``), before any side effect. Bounds a field cannot state alone (a
worker id below the world size, a buffer that fits its layout) are the data plane's checks.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

from kvblend.shm.hashing import MAX_WORLD_SIZE, MODEL_NAME_BYTES, check_label
from kvblend.shm.names import KVBUF_PATTERN

MAX_PAGED_LAYERS = 1024             # layers of a paged registration
MAX_PAGED_BUFFERS = 1024            # buffers a paged registration names
MAX_HEAD_DIM = 1024
MAX_WORKER_ID = MAX_WORLD_SIZE - 1
MAX_POSITION = 1 << 24              # positions a rotation takes (float32 holds every integer
                                    # below 2^24); also the most a rotary config's context may be

Exact = Annotated[int, msgspec.Meta(ge=0, le=2**53)]  # exact as a JSON number
Positive = Annotated[float, msgspec.Meta(gt=0)]
Size = Annotated[int, msgspec.Meta(gt=0, le=1 << 31)]


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


class _Spec(msgspec.Struct, tag_field="type", frozen=True, forbid_unknown_fields=True):
    """A buffer spec: tagged by its ``BufferKind`` in field ``type``."""


class ShmBuffer(_Spec, tag=BufferKind.SHM.value, kw_only=True):
    """A CPU buffer: a POSIX shared-memory segment that the engine created and owns, holding
    ``[2, num_layers, num_tokens, hidden_dim]`` from byte 0."""

    name: Annotated[str, msgspec.Meta(
        max_length=255, pattern=KVBUF_PATTERN,
        description="Its POSIX shared-memory name: `<shm_prefix>_kvbuf_<32 lowercase hex>`.",
        examples=["kvblend_kvbuf_5f3c2d1e8a9b4c7d9e0f1a2b3c4d5e6f"])]


class CudaIpcBuffer(_Spec, tag=BufferKind.CUDA_IPC.value, kw_only=True):
    """A GPU buffer shared by ``cudaIpcGetMemHandle``."""

    handle: Annotated[bytes, msgspec.Meta(
        min_length=64, max_length=64,
        description="The 64-byte cudaIpcMemHandle of the allocation (base64 in JSON).")]
    offset: Annotated[Exact, msgspec.Meta(
        description="Bytes from the allocation's base to the buffer's first element.")] = 0
    device_uuid: Annotated[str, msgspec.Meta(
        min_length=1, max_length=64,
        description="The GPU's UUID (hex, with or without `GPU-` and dashes), not its index.",
        examples=["GPU-5f3c2d1e-8a9b-4c7d-9e0f-1a2b3c4d5e6f"])]


class KVPlacement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where K (or V) sits in one layer of a paged cache, in elements of the dtype: element
    (block b, slot s, head h, dim d) is at ``offset + b*block + s*token + h*head + d*dim``."""

    offset: Exact
    block: Exact
    token: Exact
    head: Exact
    dim: Exact


class PagedLayer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Layer l of a paged cache: ``buffers[buffer]`` from byte ``offset``."""

    buffer: Annotated[int, msgspec.Meta(ge=0, lt=MAX_PAGED_BUFFERS,
                                        description="Index into `buffers`.")]
    offset: Annotated[Exact, msgspec.Meta(description="Bytes from that buffer's start to the "
                                                      "layer.")]


class PagedBuffer(_Spec, tag=BufferKind.PAGED.value, kw_only=True):
    """A paged KV cache: per-layer tensors in one or more shared buffers (each buffer ``offset``
    0: the layers carry their own), K and V placed by strides (the layout table of
    ``dataplane.paged``). Its blocks hold ``block_size`` tokens each; store and retrieve name them
    by a block table. ``num_tokens`` is then ``num_blocks * block_size``, ``hidden_dim``
    ``kv_heads * head_dim``."""

    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 20, examples=[16])]
    num_blocks: Annotated[Size, msgspec.Meta(examples=[2048])]
    kv_heads: Annotated[int, msgspec.Meta(gt=0, le=1 << 16, examples=[8])]
    head_dim: Annotated[int, msgspec.Meta(gt=0, le=1 << 16, examples=[128])]
    k: KVPlacement
    v: KVPlacement
    layer_bytes: Annotated[Exact, msgspec.Meta(
        description="Bytes of one layer from its offset; every element K and V address lies "
                    "in it.")]
    buffers: Annotated[list[ShmBuffer | CudaIpcBuffer],
                       msgspec.Meta(min_length=1, max_length=MAX_PAGED_BUFFERS)]
    layers: Annotated[list[PagedLayer], msgspec.Meta(min_length=1, max_length=MAX_PAGED_LAYERS)]


BufferSpec = ShmBuffer | CudaIpcBuffer | PagedBuffer


class RotaryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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

    head_dim: Annotated[int, msgspec.Meta(ge=2, le=MAX_HEAD_DIM, examples=[128])]
    rotary_dim: Annotated[int, msgspec.Meta(ge=0, le=MAX_HEAD_DIM)] = 0
    theta: Positive = 10000.0
    style: Literal["neox", "gptj"] = "neox"
    scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: Positive = 1.0
    low_freq_factor: Positive = 1.0
    high_freq_factor: Positive = 4.0
    original_max_position_embeddings: Annotated[int, msgspec.Meta(ge=1, le=MAX_POSITION)] = 8192
    beta_fast: Positive = 32.0
    beta_slow: Positive = 1.0
    truncate: bool = True
    inv_freq: Annotated[list[float], msgspec.Meta(max_length=MAX_HEAD_DIM // 2)] | None = None

    @property
    def dim(self) -> int:
        """The dims that rotate."""
        return self.rotary_dim or self.head_dim


class Registration(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An engine worker's KV cache: a buffer ``[2, num_layers, num_tokens, hidden_dim]`` in POSIX
    shared memory (``shm``) or on a GPU (``cuda_ipc``), or per-layer paged tensors (``paged``).
    The instance lives while its lease is renewed. With ``rotary`` (the model's rotary config)
    its retrieves turn K to the prompt's positions."""

    model_name: Annotated[str, msgspec.Meta(
        min_length=1, max_length=MODEL_NAME_BYTES,
        description=f"Printable UTF-8 without NUL, 1 to {MODEL_NAME_BYTES} bytes.",
        examples=["meta-llama/Llama-3.1-8B-Instruct"])]
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE,
                                            description="Tensor-parallel ranks.")] = 1
    worker_id: Annotated[Annotated[int, msgspec.Meta(ge=0, le=MAX_WORKER_ID)] | None,
                         msgspec.Meta(description="Tensor-parallel rank; null means 0.")] = 0
    num_layers: Annotated[int, msgspec.Meta(gt=0, le=1 << 16, examples=[32])]
    num_tokens: Annotated[Size, msgspec.Meta(description="Token capacity of the buffer.",
                                             examples=[32768])]
    hidden_dim: Annotated[int, msgspec.Meta(gt=0, le=1 << 20, examples=[1024],
                                            description="kv_heads * head_dim of this shard.")]
    dtype: WireDType = WireDType.FLOAT16
    buffer: Annotated[BufferSpec, msgspec.Meta(description="Where the KV is, by its `type`.")]
    rotary: Annotated[RotaryConfig | None, msgspec.Meta(
        description="The model's rotary config: retrieves then turn K to the prompt's "
                    "positions.")] = None
    order_word: Annotated[CudaIpcBuffer | None, msgspec.Meta(
        description="A 4-byte word on the buffer's GPU (CUDA buffers) that the engine's stream "
                    "writes a rising count into; a store or retrieve naming a count (`order`) "
                    "then has the data plane wait until the word reaches it, instead of for an "
                    "interprocess event.")] = None
    ready_word: Annotated[bool, msgspec.Meta(
        description="With `order_word`: the int32 right after it, in the same allocation, is "
                    "the instance's ready word. After each group of a layer-wise retrieve "
                    "that names no `layer_events`, the data plane's stream writes a rising "
                    "count into it and the group's progress frame names the count; the "
                    "engine's stream waits for it instead of for an interprocess event.")] = False

    def __post_init__(self) -> None:
        """Refuse a model name ``shm.hashing.check_label`` refuses, or a ready word without an
        order word (a ``ValueError``, which a decoder raises as ``msgspec.ValidationError``)."""
        check_label("model_name", self.model_name, MODEL_NAME_BYTES)
        if self.ready_word and self.order_word is None:
            raise ValueError("a ready_word is the word after the order_word: register both")


__all__ = ["Registration", "BufferSpec", "ShmBuffer", "CudaIpcBuffer", "PagedBuffer",
           "KVPlacement", "PagedLayer", "RotaryConfig", "WireDType", "BufferKind",
           "MAX_PAGED_LAYERS", "MAX_PAGED_BUFFERS", "MAX_HEAD_DIM", "MAX_POSITION"]
