"""Key words built without key objects (the data plane's batches) equal those of ``ChunkKey``s,
and turn back into the same keys; a malformed word array is refused."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvblend.shm.keys import ChunkKey, batch_words, key_words, keys_of


@pytest.mark.parametrize("namespace_id", [0, 5, 2**63, 2**64 - 3])
@pytest.mark.parametrize("rank", [0, 3])
def test_batch_words_are_the_keys_words_and_turn_back(namespace_id: int, rank: int) -> None:
    hashes = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(40)]
    keys = [ChunkKey(namespace_id, h, rank) for h in hashes]
    words = batch_words(namespace_id, hashes, rank)
    assert np.array_equal(words, key_words(keys))
    assert np.array_equal(key_words(words), words)
    assert keys_of(words) == keys


def test_malformed_words_are_refused() -> None:
    with pytest.raises(ValueError):
        key_words(np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError):
        key_words(np.zeros((3, 3), np.int64))
