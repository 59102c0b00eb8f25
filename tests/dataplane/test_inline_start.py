"""A call begun on the thread that read it: where a store or retrieve hands the rest of its start
to the instance's worker (``dataplane.calls.HAND_OFF``), and how ``Instance.run_inline`` keeps the
instance's calls in order around it."""

from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import kvblend.dataplane.transfer as tr
from kvblend.dataplane.calls import HAND_OFF
from kvblend.dataplane.client_transfer import match_bytes
from kvblend.dataplane.instance import Instance
from kvblend.dataplane.messages import RetrieveChunks
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.matches import Match
from tests.dataplane.conftest import CHUNK
from tests.dataplane.test_transfer import (Recorder, grouped, make_inst,  # noqa: F401
                                           shared, store_msg)

DEADLINE = 60.0  # seconds: a bound on waits that end at once when the code is right


def _copied(buf: Recorder) -> list[int]:
    return [e[1] for e in buf.log if e[0] == "copy"]


def test_a_store_and_a_retrieve_hand_off_once_their_first_batch_is_queued(
        grouped: tr.Shared) -> None:  # noqa: F811
    inst = make_inst(grouped)  # batches of 2, then 4, then 6 chunks
    buf = inst.buffer
    assert isinstance(buf, Recorder)
    tokens = np.arange(12 * CHUNK) + 5
    store = tr.store_call(grouped, inst, store_msg(tokens))  # type: ignore[arg-type]
    assert next(store) is HAND_OFF
    assert _copied(buf) == [0, 1]  # the first batch only
    assert next(store) is None  # every copy queued
    assert _copied(buf) == list(range(12))
    assert tr.run_to_end(store).copied == 12

    hashes = chunk_hashes(Namespace("m", 1, ""), tokens, CHUNK)
    msg = RetrieveChunks(instance_id=1, token_ids=tokens.astype("<u4").tobytes(),
                         matches=match_bytes([Match(0, CHUNK, j * CHUNK, (j + 1) * CHUNK, h)
                                              for j, h in enumerate(hashes)]),
                         offset=0, cache_salt="", event=None, done_event=None, request_id="q")
    buf.log.clear()
    retrieve = tr.retrieve_call(grouped, inst, msg)  # type: ignore[arg-type]
    assert next(retrieve) is HAND_OFF
    assert _copied(buf) == [0, 1]
    assert next(retrieve) is None
    assert _copied(buf) == list(range(12))
    assert tr.run_to_end(retrieve).copied == 12
    assert grouped.store.stats().num_pinned == 0


class _Promoter:
    """Stands in for the remote tier's promoter: records that it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def ensure(self, *args: Any) -> None:
        self.asked += 1


def test_a_retrieve_that_may_promote_hands_off_before_anything_else(
        shared: tr.Shared) -> None:  # noqa: F811
    promoter = _Promoter()
    sh = replace(shared, promoter=promoter)  # type: ignore[arg-type]
    inst = make_inst(sh)
    tokens = np.arange(2 * CHUNK) + 9
    assert tr.run_store(sh, inst, store_msg(tokens)).copied == 2  # type: ignore[arg-type]
    buf = inst.buffer
    assert isinstance(buf, Recorder)
    buf.log.clear()
    h = chunk_hashes(Namespace("m", 1, ""), tokens, CHUNK)[0]
    msg = RetrieveChunks(instance_id=1, token_ids=tokens.astype("<u4").tobytes(),
                         matches=match_bytes([Match(0, CHUNK, 0, CHUNK, h)]), offset=0,
                         cache_salt="", event=None, done_event=None, request_id="q")
    call = tr.retrieve_call(sh, inst, msg)  # type: ignore[arg-type]
    assert next(call) is HAND_OFF
    assert promoter.asked == 0 and buf.log == []  # nothing began: a fetch may wait on the network
    assert tr.run_to_end(call).copied == 1 and promoter.asked == 1


# -- Instance.run_inline ---------------------------------------------------------------------


@pytest.fixture
def inst() -> Generator[Instance, None, None]:
    """A real instance's worker and completion thread; its buffer is never touched here."""
    i = Instance(id=7, token="t", request=None, layout=None, class_id=0,  # type: ignore[arg-type]
                 buffer=None, owner_uid=0, client=None, expires=0.0)  # type: ignore[arg-type]
    i.start()
    yield i
    if i.thread is not None and i.thread.is_alive():
        i.submit(lambda _: False, bounded=False)
        i.thread.join(DEADLINE)


class _Ended:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = 0

    def __call__(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error, self.thread = result, error, threading.get_ident()
        self.event.set()

    def wait(self) -> "_Ended":
        assert self.event.wait(DEADLINE), "the call never ended"
        return self


def _call(where: dict[str, int], order: list[str], head: Any = None) -> Generator[Any, None, str]:
    """A call that notes which thread ran each part: its head (``head()`` runs in it), the rest
    of its start after ``HAND_OFF``, and its end."""
    where["head"] = threading.get_ident()
    order.append("head")
    if head is not None:
        head()
    yield HAND_OFF
    where["rest"] = threading.get_ident()
    order.append("rest")
    yield None
    where["end"] = threading.get_ident()
    return "result"


def test_a_call_on_an_idle_instance_begins_on_the_calling_thread(inst: Instance) -> None:
    where: dict[str, int] = {}
    ended = _Ended()
    assert inst.run_inline(_call(where, []), ended, store=False)
    assert ended.wait().result == "result" and ended.error is None
    me = threading.get_ident()
    assert where["head"] == me  # up to its hand-off here
    assert where["rest"] != me and where["end"] != me  # the rest on the instance's threads
    inst.settle()
    where.clear()
    again = _Ended()
    assert inst.run_inline(_call(where, []), again, store=True)  # idle again: begun here again
    assert again.wait().result == "result" and where["head"] == me


def test_a_busy_or_dropping_instance_begins_nothing_on_the_calling_thread(
        inst: Instance) -> None:
    busy, release = threading.Event(), threading.Event()

    def block(_: Instance) -> bool:
        busy.set()
        return release.wait(DEADLINE)

    inst.submit(block)
    assert busy.wait(DEADLINE)
    where: dict[str, int] = {}
    assert not inst.run_inline(_call(where, []), _Ended(), store=False)  # a job is running
    assert where == {}  # and nothing of the call ran
    release.set()
    inst.settle()
    inst.dropping = True
    assert not inst.run_inline(_call(where, []), _Ended(), store=False)
    assert where == {}
    inst.dropping = False
    inst.submit(lambda _: False)  # the worker stops
    assert inst.thread is not None
    inst.thread.join(DEADLINE)
    assert not inst.run_inline(_call(where, []), _Ended(), store=False)
    assert where == {}


def test_calls_sent_during_an_inline_start_run_after_its_rest(inst: Instance) -> None:
    order: list[str] = []
    later_ran = threading.Event()
    ends = [_Ended() for _ in range(3)]

    def job(name: str, ended: _Ended) -> Any:
        def run(i: Instance) -> bool:
            later_ran.set()
            i.run_call(_call({}, order, lambda: order.append(name)), ended, store=False)
            return True
        return run

    def head() -> None:  # calls arrive on another thread while the first is begun here
        sender = threading.Thread(target=lambda: [inst.submit(job(n, e)) for n, e in
                                                  (("second", ends[1]), ("third", ends[2]))])
        sender.start()
        sender.join(DEADLINE)
        # they must wait for the rest of this call: not one starts while it is begun here
        assert not later_ran.wait(0.2)

    assert inst.run_inline(_call({}, order, head), ends[0], store=False)
    for e in ends:
        assert e.wait().error is None
    assert order == ["head", "rest", "head", "second", "rest", "head", "third", "rest"]


def test_a_call_that_fails_in_its_inline_start_leaves_the_instance_idle(
        inst: Instance) -> None:
    def failing() -> Generator[Any, None, str]:
        raise ValueError("refused by its checks")
        yield HAND_OFF  # a generator, as a call is

    def at_once() -> Generator[Any, None, str]:
        return "nothing to copy"
        yield HAND_OFF

    ended = _Ended()
    assert inst.run_inline(failing(), ended, store=True)
    assert isinstance(ended.wait().error, ValueError)
    assert ended.thread == threading.get_ident()  # answered here: it never reached a copy
    done = _Ended()
    assert inst.run_inline(at_once(), done, store=False)  # idle again, stores counted off
    assert done.wait().result == "nothing to copy"
    where: dict[str, int] = {}
    last = _Ended()
    assert inst.run_inline(_call(where, []), last, store=False)
    assert last.wait().result == "result"
