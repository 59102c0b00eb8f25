"""The order word's counts (``dataplane.streamword``): which of two 32-bit counts comes later, as
the data plane keeps the highest count named to release the word, across the wrap; and the ready
word, which a registration has only after an order word."""

from __future__ import annotations

import base64

import msgspec
import pytest

from kvblend.dataplane import streamword
from kvblend.dataplane.registration import Registration


def test_later_counts_across_the_wrap() -> None:
    top = streamword.MASK
    assert streamword.later(1, 0) and not streamword.later(0, 1)
    assert not streamword.later(5, 5)
    assert streamword.later(0, top) and streamword.later(3, top - 2)  # wrapped: still later
    assert not streamword.later(top, 0)
    assert streamword.later((1 << 31) - 1, 0) and not streamword.later(0, (1 << 31) - 1)


def test_a_ready_word_comes_only_after_an_order_word() -> None:
    buffer = {"type": "cuda_ipc", "handle": base64.b64encode(b"h" * 64).decode(),
              "device_uuid": "GPU-0"}
    body = {"model_name": "m", "num_layers": 2, "num_tokens": 64, "hidden_dim": 8,
            "buffer": buffer, "ready_word": True}
    with pytest.raises(msgspec.ValidationError, match="ready_word"):
        msgspec.json.decode(msgspec.json.encode(body), type=Registration)
    reg = msgspec.json.decode(msgspec.json.encode({**body, "order_word": buffer}),
                              type=Registration)
    assert reg.ready_word and reg.order_word is not None
