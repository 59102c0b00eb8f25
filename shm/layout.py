"""Geometry: the engine's KV buffer layout and the store's layout classes.

``KVLayout`` describes one engine worker's buffer ``[2, L, T, D]``. ``ChunkClass`` is one layout class
of the store: every chunk of one ``(model, world_size, dtype, L, D, chunk_size)`` has the same size,
so it gets a fixed-size slot. Both are frozen and validated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from kvblend.shm.hashing import MODEL_NAME_BYTES, check_label

ALIGN = 4096


class DType(IntEnum):
    """KV element types a buffer may hold (codes are stored in shared memory: never renumber)."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @classmethod
    def parse(cls, name: "str | DType") -> "DType":
        if isinstance(name, DType):
            return name
        key = str(name).removeprefix("torch.").upper()
        try:
            return cls[key]
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}: use float16, bfloat16 or float32") from None

    def __str__(self) -> str:
        return self.name.lower()


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class KVLayout:
    """An engine worker's KV buffer ``[2, num_layers, num_tokens, hidden_dim]``.

    ``hidden_dim`` is kv_heads * head_dim of this worker's shard.
    """

    num_layers: int
    num_tokens: int
    hidden_dim: int
    dtype: DType = DType.FLOAT16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        for name in ("num_layers", "num_tokens", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.hidden_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.num_tokens

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.bytes_per_token * chunk_size

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_layers, self.num_tokens, self.hidden_dim)


@dataclass(frozen=True)
class ChunkClass:
    """A layout class of the store: all chunks of one model shard and chunk size.

    A slot is ``header_bytes`` (key, state, token ids) followed by the chunk's KV bytes
    ``[2, num_layers, chunk_size, hidden_dim]``. Both parts are rounded to ``align``: 4 KiB for
    chunks of 64 KiB and more (page-aligned DMA), 256 B for tiny ones (tests, index benchmarks).
    """

    model_name: str
    world_size: int
    num_layers: int
    hidden_dim: int
    dtype: DType
    chunk_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        check_label("model_name", self.model_name, MODEL_NAME_BYTES)
        for name in ("world_size", "num_layers", "hidden_dim", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, model_name: str, world_size: int, layout: KVLayout, chunk_size: int) -> "ChunkClass":
        return cls(model_name, world_size, layout.num_layers, layout.hidden_dim, layout.dtype,
                   chunk_size)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_layers, self.chunk_size, self.hidden_dim)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.num_layers * self.chunk_size * self.hidden_dim * self.dtype.itemsize

    @property
    def align(self) -> int:
        return ALIGN if self.kv_bytes >= 64 << 10 else 256

    @property
    def header_bytes(self) -> int:
        return round_up(SLOT_HEADER_FIXED + 4 * self.chunk_size, self.align)

    @property
    def slot_bytes(self) -> int:
        return self.header_bytes + round_up(self.kv_bytes, self.align)

    def numpy_dtype(self) -> np.dtype:
        """Element type for numpy views (bfloat16 has none: viewed as uint16)."""
        return np.dtype({DType.FLOAT16: "f2", DType.BFLOAT16: "u2", DType.FLOAT32: "f4"}[self.dtype])


# slot header: magic, state, key0, key1, namespace, rank, class, pid, num_tokens, reserved[7]
SLOT_HEADER_FIXED = 16 * 8
