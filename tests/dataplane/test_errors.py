"""Errors cross each boundary through one table: every exception class keeps its kind through a
data-plane reply, its status through the API, and comes back as itself in the client."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvblend.api import errors as api_errors
from kvblend.dataplane import errors as dp
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.messages import ErrorReply, reply_decoder
from kvblend.shm import errors as shm
from tests.dataplane.conftest import DataPlaneProc


def _tree(root: type) -> list[type]:
    out, todo = [], [root]
    while todo:
        klass = todo.pop()
        out.append(klass)
        todo += klass.__subclasses__()
    return out


DP_CLASSES = _tree(dp.DataPlaneError)
REMOTE = [c for c in DP_CLASSES if issubclass(c, dp.RemoteError)]


def test_every_data_plane_error_has_a_status_and_each_kind_one_class() -> None:
    assert set(DP_CLASSES) - {dp.DataPlaneError} == set(dp.HTTP_STATUS)
    kinds = [c.kind for c in REMOTE]
    assert len(kinds) == len(set(kinds))


@pytest.mark.parametrize("klass", REMOTE, ids=lambda c: c.__name__)
def test_a_reply_brings_back_the_same_class(klass: type[dp.RemoteError]) -> None:
    wire = msgspec.msgpack.encode(dp.reply_for(klass("why")))
    back = dp.error_for(reply_decoder.decode(wire))  # type: ignore[arg-type]
    assert type(back) is klass and str(back) == "why"


@pytest.mark.parametrize("klass", sorted(dp.HTTP_STATUS, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_http_keeps_the_status_and_the_client_raises_the_same_class(klass: type) -> None:
    status = api_errors.status_of(klass("why"))
    assert status == dp.HTTP_STATUS[klass]
    code = api_errors.code_of(klass("why"))
    assert code == dp.PROBLEM_CODE[klass]
    assert type(dp.http_error(status, code, "why")) is klass
    assert type(dp.http_error(status, klass.__name__, "why")) is klass  # an older service's code


@pytest.mark.parametrize("klass", _tree(api_errors.ApiError)[1:], ids=lambda c: c.__name__)
def test_every_api_error_has_a_status_the_client_understands(klass: type) -> None:
    status = api_errors.status_of(klass("why"))
    assert 400 <= status < 500
    assert type(dp.http_error(status, api_errors.code_of(klass("why")), "why")) is not dp.RemoteError


@pytest.mark.parametrize("klass", _tree(shm.ShmError), ids=lambda c: c.__name__)
def test_a_store_error_means_the_same_in_a_reply_and_in_the_api(klass: type) -> None:
    ours = dp.remote_error(klass("why"))
    assert api_errors.status_of(klass("why")) == dp.HTTP_STATUS[type(ours)]


def test_an_unexpected_error_is_a_500_not_a_422() -> None:
    assert api_errors.status_of(ValueError("a bug")) == 500
    assert api_errors.status_of(api_errors.InvalidInput("a bad label")) == 422
    assert type(dp.remote_error(RuntimeError("x"))) is dp.BackendError


@pytest.mark.slow
def test_a_full_class_table_is_capacity_not_a_layout_mismatch(dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=dataplane.address) as client:
        for m in range(32):  # every class held by a live instance
            client.register_kv_cache(client.cpu_kv_buffer(1, 64, 8, torch.float16),
                                     model_name=f"model-{m}")
        with pytest.raises(dp.CapacityExceeded, match="layout classes"):
            client.register_kv_cache(client.cpu_kv_buffer(1, 64, 8, torch.float16),
                                     model_name="one-too-many")


def test_error_reply_kinds_are_all_decodable() -> None:
    for klass in REMOTE:
        frame = msgspec.msgpack.encode(ErrorReply(kind=klass.kind, message=""))
        assert reply_decoder.decode(frame).kind == klass.kind
