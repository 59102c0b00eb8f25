"""Real ``redis-server`` processes for the remote tier's tests: a standalone server and a 3-master cluster.

This module owns the processes, their ports and temp dirs, and waiting until they answer (a bounded poll,
never a fixed sleep). It does not own the tier: tests reach the servers through ``redis://`` urls and
``(host, port)`` seeds only.

Every test under ``tests/remote`` is skipped when ``redis-server`` is not on PATH; with
``KVBLEND_REQUIRE_REDIS=1`` (set by ``.ci/run``) it fails instead, so CI never skips them silently.

Fixtures:
    redis_server   (module)   a running :class:`RedisProc`
    redis_url      (function) ``redis_server``'s url, FLUSHALLed first (and the server started if a
                              test left it down)
    redis_cluster  (module)   a :class:`ClusterProcs` of 3 masters, ``cluster_state:ok`` on every node
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.retry import Retry

from kvblend.dataplane.remoteformat import RemoteKey
from kvblend.shm.store import Store, StoreConfig
from tests.harness import HOST, PollTimeout, free_port, poll

SLOTS = 16384
#: generous: the suite shares two cores with other work; a healthy server answers in milliseconds
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
CLUSTER_TIMEOUT_S = 60.0
#: short enough that a restarted master is trusted again within seconds (a FAIL flag is cleared
#: 2 node timeouts after it was set), long enough that a loaded machine does not flap
NODE_TIMEOUT_MS = 2000
INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu)"
#: the key the tests' hosts and tiers share (``KVBLEND_REMOTE_KEY`` of a served host)
KEY_TEXT = "kvblend-tests-remote-key-0123456789"
KEY = RemoteKey(KEY_TEXT)

class RedisStartError(RuntimeError):
    """A redis-server exited or did not answer PING in time; the message ends with its log."""


def _redis_server_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return f"redis-server is not on PATH: {INSTALL_HINT}"
    return None


@pytest.fixture(autouse=True, scope="session")
def _redis_server_installed() -> None:
    """Skips every test in this folder without redis-server; fails them under KVBLEND_REQUIRE_REDIS=1."""
    missing = _redis_server_missing()
    if missing is None:
        return
    if os.environ.get("KVBLEND_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVBLEND_REQUIRE_REDIS=1 but {missing}", pytrace=False)
    pytest.skip(missing)


class RedisProc:
    """One ``redis-server`` child on 127.0.0.1 with its own temp dir and no persistence.

    The port is chosen once and kept: ``restart()`` binds the same one (and, in cluster mode, the same
    bus port and node config file, so the node rejoins as itself). ``close()`` kills the process and
    removes the dir; call it exactly once.
    """

    def __init__(self, *, cluster: bool = False) -> None:
        self.port = free_port()
        self.cluster_port: int | None = free_port({self.port}) if cluster else None
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvblend-redis-{self.port}-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"RedisProc(port={self.port}, running={self.running})"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A client of this server that fails at once when it is down (no retries, short timeouts)."""
        options: dict[str, object] = {"socket_connect_timeout": 2, "socket_timeout": 10,
                                      "retry": Retry(NoBackoff(), 0)}
        options.update(kwargs)
        return redis.Redis(host=HOST, port=self.port, **options)  # type: ignore[arg-type]

    def _args(self) -> list[str]:
        args = ["redis-server", "--bind", HOST, "--port", str(self.port), "--daemonize", "no",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no", "--logfile", ""]
        if self.cluster_port is not None:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.cluster_port),
                     "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                     # the masters left standing keep serving their own slots while one is down
                     "--cluster-require-full-coverage", "no"]
        return args

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Starts the server and returns once it answers PING.

        Raises:
            RedisStartError: it exited first, or did not answer within ``timeout`` s (it is killed).
        """
        assert not self.running, f"{self!r} is already running"
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=self.dir)
        proc = self._proc
        with self.client(socket_connect_timeout=1, socket_timeout=1) as probe:
            def up() -> bool:
                if proc.poll() is not None:
                    raise RedisStartError(f"redis-server on port {self.port} exited with "
                                          f"{proc.returncode}:\n{self.log_tail()}")
                return self._answers(probe)
            try:
                poll(up, timeout, f"redis-server on port {self.port} to answer PING")
            except PollTimeout as e:
                self.kill()
                raise RedisStartError(f"{e}:\n{self.log_tail()}") from None

    def _answers(self, probe: redis.Redis) -> bool:
        # the pid tells our server from another that took the port between choosing and binding it
        assert self._proc is not None, "_answers() before start()"
        try:
            return bool(probe.info("server").get("process_id") == self._proc.pid and probe.ping())
        except (redis.ConnectionError, redis.TimeoutError):  # refused, still loading, or not redis at all
            return False

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log (all its starts, appended)."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, then wait for the exit: nothing is written on the way down."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM (redis-server's clean shutdown), then wait for the exit."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=STOP_TIMEOUT_S)

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Stops the server if it runs, then starts it again on the same port (and cluster config)."""
        self.stop()
        self.start(timeout)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def started(*, cluster: bool = False, attempts: int = 5) -> RedisProc:
    """A started RedisProc; a port taken between choosing and binding it costs a new port, not a failure."""
    for _ in range(attempts - 1):
        proc = RedisProc(cluster=cluster)
        try:
            proc.start()
            return proc
        except RedisStartError:
            in_use = "Address already in use" in proc.log_tail()
            proc.close()
            if not in_use:
                raise
    proc = RedisProc(cluster=cluster)
    try:
        proc.start()
    except BaseException:
        proc.close()
        raise
    return proc


def _cluster_info(node: RedisProc) -> dict[str, str]:
    with node.client() as c:
        text = c.execute_command("CLUSTER", "INFO")
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    if isinstance(text, bytes):
        text = text.decode()
    return dict(line.split(":", 1) for line in str(text).splitlines() if ":" in line)


class ClusterProcs:
    """Masters with no replicas, each serving one contiguous third of the slots.

    ``nodes[i]`` serves ``slot_ranges[i]`` (inclusive bounds). A killed master is brought back with
    ``node.restart()`` followed by ``wait_ok()``: the same port and node config file make it rejoin
    with its own id and slots, empty (nothing is persisted).
    """

    def __init__(self, size: int = 3) -> None:
        bounds = [i * SLOTS // size for i in range(size + 1)]
        self.slot_ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(size)]
        self.nodes: list[RedisProc] = []
        try:
            for _ in range(size):
                self.nodes.append(started(cluster=True))
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [node.address for node in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def cluster_url(self) -> str:
        """The ``--remote`` URL of the whole cluster, from every node as a seed."""
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.seeds)

    def node_for_key(self, key: str | bytes) -> RedisProc:
        """The master that serves ``key``'s slot."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for node, (low, high) in zip(self.nodes, self.slot_ranges, strict=True):
            if low <= slot <= high:
                return node
        raise AssertionError(f"slot {slot} outside {self.slot_ranges}: "
                             f"the ranges do not cover 0..{SLOTS - 1}")

    def _create(self) -> None:
        for epoch, (node, (low, high)) in enumerate(zip(self.nodes, self.slot_ranges, strict=True), 1):
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
                # distinct epochs up front: no collision to resolve before the nodes agree
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        with self.nodes[0].client() as c:
            for node in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", HOST, node.port, node.cluster_port)
        self.wait_ok()

    def healthy(self) -> bool:
        """Every node runs and reports ``cluster_state:ok`` with every slot served by a node it trusts."""
        want = {"cluster_state": "ok", "cluster_slots_assigned": str(SLOTS), "cluster_slots_ok": str(SLOTS),
                "cluster_known_nodes": str(len(self.nodes)), "cluster_size": str(len(self.nodes))}
        for node in self.nodes:
            try:
                info = _cluster_info(node)
            except redis.ConnectionError:
                return False
            if any(info.get(k) != v for k, v in want.items()):
                return False
        return True

    def wait_failed(self, node: RedisProc, timeout: float = CLUSTER_TIMEOUT_S) -> None:
        """Returns once every other node has flagged ``node`` FAIL (not just PFAIL): all its slots count in
        their ``cluster_slots_fail``. Takes about a node timeout after ``node`` stopped answering."""
        low, high = self.slot_ranges[self.nodes.index(node)]
        others = [other for other in self.nodes if other is not node]

        def failed() -> bool:
            want = str(high - low + 1)
            return all(_cluster_info(other).get("cluster_slots_fail") == want for other in others)

        try:
            poll(failed, timeout, f"port {node.port} flagged FAIL by every other node")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; nodes see: {self._views()}") from None

    def wait_ok(self, timeout: float = CLUSTER_TIMEOUT_S) -> None:
        """Returns once :meth:`healthy`; raises TimeoutError with every node's view after ``timeout`` s."""
        try:
            poll(self.healthy, timeout, "cluster_state:ok on every node")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; nodes see: {self._views()}") from None

    def _views(self) -> dict[int, object]:
        views: dict[int, object] = {}
        for node in self.nodes:
            try:
                info = _cluster_info(node)
                views[node.port] = {k: v for k, v in info.items()
                                    if k in ("cluster_state", "cluster_slots_assigned", "cluster_slots_ok",
                                             "cluster_slots_fail", "cluster_known_nodes", "cluster_size")}
            except redis.ConnectionError as e:
                views[node.port] = repr(e)
        return views

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProc]:
    """One standalone server per test module; killed and its dir removed afterwards, pass or fail."""
    proc = started()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
def redis_url(redis_server: RedisProc) -> str:
    """The module's server, running and empty: started again if a test left it down, then FLUSHALLed."""
    if not redis_server.running:
        redis_server.start()
    with redis_server.client() as c:
        c.flushall()
    return redis_server.url


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[ClusterProcs]:
    """Three masters per test module, ``cluster_state:ok`` on each; all killed and removed afterwards."""
    cluster = ClusterProcs(3)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def store(shm_prefix: str) -> Iterator[Store]:
    """A small real store under the test's own prefix (1 MiB, 256 KiB pages)."""
    s = Store.open(shm_prefix, StoreConfig(capacity_bytes=1 << 20, page_bytes=1 << 18,
                                           min_slot_bytes=4096), wipe=True)
    yield s
    s.close()
