"""Chunk keys: prefix-chained cryptographic hashes of token chunks, rooted in a namespace.

This module owns how a stored chunk is named. It does not own where chunks live (``shm.store``)
or how they are found inside a prompt (``shm.fingerprint``).

Key of chunk i of a token sequence::

    root   = blake2b("kvblend-ns\\0" + model_name + "\\0" + world_size + "\\0" + cache_salt)
    key[0] = blake2b(root     || tokens[0:C]   as little-endian uint32)
    key[i] = blake2b(key[i-1] || tokens[iC:(i+1)C] as little-endian uint32)

All digests are 16 bytes (128 bits). Only full chunks get keys; a partial last chunk is ignored.
Nothing depends on PYTHONHASHSEED: the same tokens give the same keys in every process, forever.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

DIGEST_BYTES = 16
# The namespace's bounds, the one definition every boundary checks against (HTTP schemas, the
# lookup fast path, socket messages, the store's class-name column of 128 bytes).
MODEL_NAME_BYTES = 120
CACHE_SALT_BYTES = 256
MAX_WORLD_SIZE = 1024


def check_label(what: str, value: object, max_bytes: int, *, empty_ok: bool = False) -> str:
    """``value`` if it is printable UTF-8 of at most ``max_bytes`` bytes (no NUL, no control
    characters); model names and salts end up in shared memory, logs and metrics labels.

    Raises:
        ValueError: naming the field and the rule it breaks.
    """
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    if not value and not empty_ok:
        raise ValueError(f"{what} must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ValueError(f"{what} must be at most {max_bytes} bytes of UTF-8")
    if not value.isprintable():
        raise ValueError(f"{what} must be printable text (no NUL or control characters)")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid UTF-8 (no lone surrogates)") from None
    return value


@dataclass(frozen=True)
class Namespace:
    """Chunks of different namespaces never see each other.

    Attributes:
        model_name: the engine's model name.
        world_size: tensor-parallel degree; each rank stores its own shard under the same key.
        cache_salt: an optional tenant salt; requests with different salts share nothing.
    """

    model_name: str
    world_size: int = 1
    cache_salt: str = ""
    root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_label("model_name", self.model_name, MODEL_NAME_BYTES)
        check_label("cache_salt", self.cache_salt, CACHE_SALT_BYTES, empty_ok=True)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {self.world_size}")
        text = f"kvblend-ns\0{self.model_name}\0{self.world_size}\0{self.cache_salt}"
        digest = hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()
        object.__setattr__(self, "root", digest)

    @property
    def id(self) -> int:
        """64-bit id of the namespace (the first 8 bytes of its root, little-endian)."""
        return int.from_bytes(self.root[:8], "little")


@dataclass(frozen=True)
class Root:
    """A namespace known by its root alone: a record from another host carries the root, never
    the labels (model name, salt) it was hashed from. Indexes take it where they take a
    ``Namespace``."""

    root: bytes

    def __post_init__(self) -> None:
        if len(self.root) != DIGEST_BYTES:
            raise ValueError(f"a namespace root has {DIGEST_BYTES} bytes, got {len(self.root)}")

    @property
    def id(self) -> int:
        """As ``Namespace.id``."""
        return int.from_bytes(self.root[:8], "little")


def as_tokens(token_ids: object) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array.

    Raises:
        ValueError: an id outside [0, 2^32) or a non-1-D input.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        arr = token_ids
    else:
        raw = np.asarray(token_ids)
        if raw.size and raw.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {raw.dtype}")
        if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= 2**32):
            raise ValueError("token ids must lie in [0, 2^32)")
        arr = raw.astype(np.uint32)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_hashes(namespace: Namespace, token_ids: object, chunk_size: int,
                 parent: bytes | None = None) -> list[bytes]:
    """Keys of every full chunk of ``token_ids``, in order.

    Args:
        namespace: the chain's root.
        token_ids: 1-D integers in [0, 2^32).
        chunk_size: tokens per chunk (> 0).
        parent: the key of the chunk just before ``token_ids`` (continues a chain computed in
            pieces); None starts at the namespace's root.

    Returns:
        One 16-byte key per full chunk; the partial tail gets none.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    tokens = as_tokens(token_ids)
    raw = tokens.tobytes()
    step = chunk_size * 4
    prev = namespace.root if parent is None else parent
    keys = []
    for i in range(len(tokens) // chunk_size):
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
