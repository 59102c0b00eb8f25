"""The data plane's trust boundary, tried as an attacker would (docs/security.md).

Each test is one of the attacks that worked before the boundary existed: registering the cache's
own segments (or anyone's) as a KV buffer, bricking the layout classes with failed registrations,
reaching another engine's instance by its id, pids that do not cross containers, unbounded frames
and registrations, retrieves larger than the pin table, a planted state file, another uid on the
socket. Real data-plane processes throughout.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch

from kvblend.dataplane.channel import Channel, recv_frame
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest, DataPlaneUnavailable, TooMany
from kvblend.dataplane.messages import HEADER, MAX_FRAME, ListInstances, Ping, reply_decoder
from kvblend.shm.events import EventLog
from kvblend.shm.segment import Segment
from kvblend.shm.segment import exists as segment_exists
from kvblend.shm.store import Store
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane
from tests.dataplane.test_faults import seeded
from tests.harness import poll

pytestmark = pytest.mark.slow

L, T, D = 2, 512, 64
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another uid")


def register_msg(name: str, model: str = "m", layers: int = L) -> dict:
    """A ``RegisterInstance`` frame as an attacker sends it: a plain map, no constructor's check
    on this side."""
    return {"type": "RegisterInstance", "registration": {
        "model_name": model, "world_size": 1, "worker_id": 0, "num_layers": layers,
        "num_tokens": T, "hidden_dim": D, "dtype": "float16",
        "buffer": {"type": "shm", "name": name}}}


def kvbuf(prefix: str, owner: int | None = None) -> str:
    """A buffer of the engine name form, created here (owned by ``owner`` when given)."""
    name = f"{prefix}_kvbuf_{os.urandom(16).hex()}"
    Segment(name, 2 * L * T * D * 2, create=True).close()
    if owner is not None:
        os.chown(f"/dev/shm/{name}", owner, owner)
    return name


def num_classes(prefix: str) -> int:
    with Store.open(prefix) as store:
        return len(store.stats().classes)


# -- 1, 2: any /dev/shm entry could be registered, overwritten, then unlinked -----------------


@pytest.mark.parametrize("target", ["meta", "slab", "fp", "events", "other_service", "dotdot",
                                    "nobodys_kvbuf", "symlinked_kvbuf"])
def test_only_the_clients_own_buffers_can_be_registered(dataplane: DataPlaneProc,
                                                        target: str) -> None:
    prefix = dataplane.prefix
    other = f"{prefix}x_meta"  # the segment of another service whose prefix starts like ours
    Segment(other, 4096, create=True).close()
    if target in ("nobodys_kvbuf", "symlinked_kvbuf") and os.geteuid() != 0:
        pytest.skip("needs root to make files of another uid")
    name = {"meta": f"{prefix}_meta", "slab": f"{prefix}_slab", "fp": f"{prefix}_fp",
            "events": f"{prefix}_events", "other_service": other,
            "dotdot": f"{prefix}_kvbuf_../../etc/passwd"}.get(target)
    if target == "nobodys_kvbuf":
        name = kvbuf(prefix, owner=NOBODY)
    if target == "symlinked_kvbuf":
        name = f"{prefix}_kvbuf_{os.urandom(16).hex()}"
        os.symlink(f"/dev/shm/{prefix}_meta", f"/dev/shm/{name}")
    assert name is not None
    before = {p: os.stat(f"/dev/shm/{p}") for p in (f"{prefix}_meta", f"{prefix}_fp", other)}
    with Channel(dataplane.address) as ch:
        with pytest.raises(BadRequest):
            ch.call(register_msg(name), timeout=30)
        assert ch.call(ListInstances(), timeout=30).instances == []
    for path, st in before.items():  # still there, and not written to
        now = os.stat(f"/dev/shm/{path}")
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns,
                                                               st.st_size)
    if target == "nobodys_kvbuf":
        assert segment_exists(name)
    assert num_classes(prefix) == 0  # a refused registration created no layout class


def _refused_and_untouched(dataplane: DataPlaneProc, name: str) -> None:
    """Registering ``name`` is refused, and the store's own segments are neither written nor
    replaced: the store still opens and serves."""
    prefix = dataplane.prefix
    own = [f"/dev/shm/{prefix}_{n}" for n in ("meta", "slab", "fp", "events")]
    before = {p: os.stat(p) for p in own if os.path.exists(p)}
    with Channel(dataplane.address) as ch:
        with pytest.raises(BadRequest, match="link|service's own"):
            ch.call(register_msg(name), timeout=30)
        assert ch.call(ListInstances(), timeout=30).instances == []
    for path, st in before.items():
        now = os.stat(path)
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns,
                                                               st.st_size)
    assert num_classes(prefix) == 0


@pytest.mark.parametrize("target", ["meta", "slab", "fp", "events"])
def test_a_hard_link_to_the_services_own_segment_is_refused(dataplane: DataPlaneProc,
                                                            target: str) -> None:
    prefix = dataplane.prefix
    name = f"{prefix}_kvbuf_{os.urandom(16).hex()}"
    os.link(f"/dev/shm/{prefix}_{target}", f"/dev/shm/{name}")  # the engine name rule, met
    try:
        _refused_and_untouched(dataplane, name)
    finally:
        os.unlink(f"/dev/shm/{name}")
    with BlendClient(dataplane_address=dataplane.address) as client:  # the store is intact
        inst = client.register_kv_cache(client.cpu_kv_buffer(L, T, D, torch.float16), "m")
        assert client.store_pre_computed(inst, np.arange(2 * CHUNK)).wait().ok


def test_the_services_segment_under_a_buffer_name_alone_is_refused(
        dataplane: DataPlaneProc) -> None:
    """One link, but the inode is the store's metadata (its own name moved away): refused by
    identity, as the data plane saw its segments at start."""
    prefix = dataplane.prefix
    meta, name = f"/dev/shm/{prefix}_meta", f"{prefix}_kvbuf_{os.urandom(16).hex()}"
    os.rename(meta, f"/dev/shm/{name}")
    try:
        with Channel(dataplane.address) as ch:
            with pytest.raises(BadRequest, match="service's own"):
                ch.call(register_msg(name), timeout=30)
    finally:
        os.rename(f"/dev/shm/{name}", meta)
    assert num_classes(prefix) == 0


def test_a_buffer_with_two_links_is_refused_and_one_with_one_is_accepted(
        dataplane: DataPlaneProc) -> None:
    prefix = dataplane.prefix
    name, twin = kvbuf(prefix), f"{prefix}_kvbuf_{os.urandom(16).hex()}"
    os.link(f"/dev/shm/{name}", f"/dev/shm/{twin}")
    try:
        _refused_and_untouched(dataplane, name)
    finally:
        os.unlink(f"/dev/shm/{twin}")
    with Channel(dataplane.address) as ch:  # its one link back: the engine's own buffer
        assert ch.call(register_msg(name), timeout=30).instance_id >= 0
    os.unlink(f"/dev/shm/{name}")


# -- 3: one failed request bricked registrations and layout classes ---------------------------


def test_failed_registrations_create_nothing_and_unused_classes_are_released(
        dataplane: DataPlaneProc) -> None:
    prefix = dataplane.prefix
    with BlendClient(dataplane_address=dataplane.address) as client, \
            Channel(dataplane.address) as ch:
        for model in ("\u0000", "bad\nname", "x" * 121):
            with pytest.raises(BadRequest):
                ch.call(register_msg(f"{prefix}_kvbuf_{'0' * 32}", model=model), timeout=30)
        with pytest.raises(BadRequest):  # another geometry of "m", its buffer missing
            ch.call(register_msg(f"{prefix}_kvbuf_{'1' * 32}", layers=L + 3), timeout=30)
        assert num_classes(prefix) == 0
        for i in range(40):  # more models than the store has layout classes (32)
            kv = client.cpu_kv_buffer(L, T, D, torch.float16)
            client.unregister(client.register_kv_cache(kv, model_name=f"model-{i}"))
        kv = client.cpu_kv_buffer(L, T, D, torch.float16)
        inst = client.register_kv_cache(kv, model_name="m")  # the real engine of "m"
        assert client.store_pre_computed(inst, np.arange(2 * CHUNK)).wait().ok
        assert num_classes(prefix) == 1
        assert {i.model_name for i in client.list_instances()} == {"m"}


# -- 4: engines were not isolated -------------------------------------------------------------

_INTRUDER = """
import sys, numpy as np
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.errors import Forbidden
from kvblend.dataplane.messages import RetrieveChunks, StoreChunks, UnregisterInstance, RenewLease
victim, address = int(sys.argv[1]), sys.argv[2]
tokens = np.arange(4 * 16, dtype="<u4").tobytes()
refused = 0
with Channel(address) as ch:
    for token in ("", "0" * 32, "guess"):
        for msg in (StoreChunks(instance_id=victim, token_ids=tokens, token=token),
                    RetrieveChunks(instance_id=victim, token_ids=tokens, matches=b"", token=token),
                    RenewLease(instance_id=victim, token=token),
                    UnregisterInstance(instance_id=victim, token=token)):
            try:
                ch.call(msg, timeout=30)
            except Forbidden:
                refused += 1
print(refused, flush=True)
"""


def test_another_engine_cannot_reach_an_instance_by_its_id(dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(L, T, D, torch.float16)
        seeded(kv, 3)
        ref = kv.clone()
        inst = client.register_kv_cache(kv, model_name="m")
        out = subprocess.run([sys.executable, "-c", _INTRUDER, str(inst), dataplane.address],
                             capture_output=True, timeout=120, check=True)
        assert out.stdout.split() == [b"12"]  # every call of the intruder was refused
        assert torch.equal(kv.view(torch.int16), ref.view(torch.int16))  # nothing written
        assert [i.instance_id for i in client.list_instances()] == [inst]
        assert client.store_pre_computed(inst, np.arange(4 * CHUNK)).wait().ok  # still ours


# -- 6: pids do not cross containers; leases do ----------------------------------------------

_ENGINE = """
import sys, torch
from kvblend.dataplane.client import BlendClient
c = BlendClient(dataplane_address=sys.argv[1])
inst = c.register_kv_cache(c.cpu_kv_buffer(2, 512, 64, torch.float16), model_name="m")
print(inst, flush=True)
sys.stdin.read()
"""


def test_a_live_engine_keeps_its_instance_and_a_dead_one_loses_it(
        dataplane: DataPlaneProc) -> None:
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, dataplane.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert engine.stdout is not None and engine.stdin is not None
    inst = int(engine.stdout.readline())
    events = EventLog.open(dataplane.prefix)
    with Channel(dataplane.address) as ch:
        listed = lambda: [i.instance_id for i in ch.call(ListInstances(), timeout=30).instances]
        # four renewals at a third of the lease each: more than a whole lease has passed
        poll(lambda: events.counters().get("lease_renewals", 0) >= 4, 60, "four lease renewals")
        assert listed() == [inst] and events.counters().get("instances_expired", 0) == 0
        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=30)
        poll(lambda: listed() == [], 60, "the dead engine's instance to go")
    assert events.counters()["instances_expired"] == 1
    events.close()
    engine.stdin.close()
    engine.stdout.close()


# -- 7: unbounded inputs -------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_an_oversized_frame_closes_the_connection_before_any_allocation(
        dataplane: DataPlaneProc) -> None:
    before = rss_kib(dataplane.proc.pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(dataplane.address)
        sock.sendall(HEADER.pack(1 << 30, 1) + b"x" * 64)  # announces 1 GiB
        sock.settimeout(30)
        try:
            got = sock.recv(1)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            got = b""
        assert got == b""  # closed by the data plane
    assert rss_kib(dataplane.proc.pid) - before < MAX_FRAME // 1024
    with Channel(dataplane.address) as ch:
        assert ch.call(Ping(), timeout=30).chunk_size == CHUNK


def unread(sock: socket.socket) -> int:
    """Bytes this side sent that the peer has not read yet (SIOCOUTQ of a Unix stream socket)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0]


def padded_ping(size: int) -> bytes:
    """A ``Ping`` payload of exactly ``size`` bytes: the decoder skips the unknown ``pad``."""
    pad = size
    while True:
        payload = msgspec.msgpack.encode({"type": "Ping", "pad": b"x" * pad})
        if len(payload) == size:
            return payload
        pad += size - len(payload)


def test_a_frame_holds_the_bytes_received_not_the_length_announced(
        dataplane: DataPlaneProc) -> None:
    n, payload = 20, padded_ping(MAX_FRAME)
    head, start = HEADER.pack(len(payload), 1), 1024
    before = rss_kib(dataplane.proc.pid)
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.connect(dataplane.address)
            sock.sendall(head + payload[:start])  # announces 8 MiB, sends 1 kB
        poll(lambda: all(unread(s) == 0 for s in socks), 60, "the data plane to read every start")
        grown = rss_kib(dataplane.proc.pid) - before
        assert grown < n * MAX_FRAME // 4 // 1024, f"{grown} KiB for {n} frames of {start} bytes"
        for sock in socks:  # completed, each frame is served as any other
            sock.sendall(payload[start:])
        for sock in socks:
            sock.settimeout(30)
            call_id, reply = recv_frame(sock)
            assert call_id == 1 and reply_decoder.decode(reply).chunk_size == CHUNK
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def limited(shm_prefix: str) -> Iterator[DataPlaneProc]:
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, "cpu", 60.0, max_instances=3, max_instances_per_client=2,
                         max_connections=3)
    yield dp
    if dp.proc.poll() is None:
        assert dp.stop() == 0


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_instances_and_connections_are_bounded(limited: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=limited.address) as a, \
            BlendClient(dataplane_address=limited.address) as b:
        for _ in range(2):
            a.register_kv_cache(a.cpu_kv_buffer(L, T, D, torch.float16), model_name="m")
        with pytest.raises(TooMany, match="per-client"):
            a.register_kv_cache(a.cpu_kv_buffer(L, T, D, torch.float16), model_name="m")
        b.register_kv_cache(b.cpu_kv_buffer(L, T, D, torch.float16), model_name="m")
        running = threads(limited.proc.pid)
        for _ in range(10):  # refused registrations start no thread (there was one each)
            with pytest.raises(TooMany, match="max-instances"):
                b.register_kv_cache(b.cpu_kv_buffer(L, T, D, torch.float16), model_name="m")
        assert threads(limited.proc.pid) == running
        with Channel(limited.address) as third, Channel(limited.address) as fourth:
            assert third.call(Ping(), timeout=30)  # the third connection: at the limit
            with pytest.raises(DataPlaneUnavailable):
                fourth.call(Ping(), timeout=30)  # closed at accept


def test_a_retrieve_larger_than_the_pin_table_is_served_whole(shm_prefix: str) -> None:
    n = 3000  # the pin table holds 2048 pins
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix)
    try:
        with BlendClient(dataplane_address=dp.address) as client:
            kv = client.cpu_kv_buffer(L, n * CHUNK, 8, torch.float16)
            seeded(kv, 9)
            ref = kv.clone()
            inst = client.register_kv_cache(kv, model_name="m")
            doc = np.arange(n * CHUNK) + 7
            assert client.store_pre_computed(inst, doc).wait(timeout=300).ok
            res = client.lookup(doc, "m")
            assert len(res.matches) == n
            kv.zero_()
            done = client.retrieve(inst, doc, res.matches).wait(timeout=300)
            assert done.ok and done.copied == n
            assert torch.equal(kv.view(torch.int16), ref.view(torch.int16))
            with Store.open(shm_prefix) as store:
                assert store.stats().num_pinned == 0
    finally:
        assert dp.stop() == 0


# -- 5: a planted state file -------------------------------------------------------------------


def test_a_planted_state_file_stops_the_data_plane_and_is_left_alone(
        shm_prefix: str, tmp_path: object) -> None:
    create_store(shm_prefix)
    victim = os.path.join(str(tmp_path), "victim")
    with open(victim, "w") as f:
        f.write("precious")
    os.symlink(victim, f"/dev/shm/{shm_prefix}_dataplane.json")
    with pytest.raises(RuntimeError, match="exited with 2"):
        start_dataplane(shm_prefix)
    with open(victim) as f:
        assert f.read() == "precious"
    assert os.path.islink(f"/dev/shm/{shm_prefix}_dataplane.json")


# -- a second Unix user ------------------------------------------------------------------------


def as_user(uid: int, action: Callable[[], bytes]) -> bytes:
    """Run ``action`` in a forked child under ``uid``; its result (or the error's name)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, act, report, exit without cleanup
        os.close(r)
        try:
            os.setgid(uid)
            os.setuid(uid)
            out = action()
        except BaseException as exc:
            out = type(exc).__name__.encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def ping_raw(address: str) -> Callable[[], bytes]:
    def act() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(address)  # PermissionError when the socket file refuses us
            try:
                sock.sendall(HEADER.pack(1, 1) + b"\x80")  # an (empty) msgpack map
                return b"answered" if sock.recv(HEADER.size) else b"closed"
            except (BrokenPipeError, ConnectionResetError):  # closed before or after our bytes
                return b"closed"
    return act


@as_root
def test_another_uid_cannot_use_the_socket(dataplane: DataPlaneProc) -> None:
    assert as_user(NOBODY, ping_raw(dataplane.address)) == b"PermissionError"  # mode 0600
    assert ping_raw(dataplane.address)() == b"answered"  # the service's own uid is served
    os.chmod(dataplane.address, 0o666)  # even with the file opened up, SO_PEERCRED refuses
    assert as_user(NOBODY, ping_raw(dataplane.address)) == b"closed"
    for name in ("meta", "slab", "fp", "events"):
        path = f"/dev/shm/{dataplane.prefix}_{name}"
        assert as_user(NOBODY, lambda: open(path, "rb").read(1)) == b"PermissionError"
