"""``kvblend serve`` as a process: configuration failures end it with one line, crashes after a
good start come back at once, only a crash loop backs off."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stderr_lines import collect_stderr
from tests.test_e2e import START_DEADLINE, free_port, kvblend_argv, poll

SMALL = ["--backend", "cpu", "--storage-mb", "8", "--page-mb", "1", "--min-slot-kb", "4",
         "--fingerprint-capacity", "4096", "--log-level", "info"]


class Serve:
    """A ``kvblend serve`` whose stderr lines are collected as they come."""

    def __init__(self, prefix: str, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get(
            "NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "numba"))}
        self.proc = subprocess.Popen(
            [*kvblend_argv(), "serve", "--port", str(self.port), "--shm-prefix", prefix, *SMALL,
             *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines, self._reader = collect_stderr(self.proc)

    def errors(self) -> list[str]:
        return [line for line in self.lines if " ERROR " in line]

    def ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def status(self) -> dict:
        return dict(httpx.get(f"http://127.0.0.1:{self.port}/v1/status", timeout=10).json())

    def wait(self) -> int:
        rc = self.proc.wait(START_DEADLINE)
        self._reader.join(30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return rc


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            s.wait()


def test_a_taken_port_ends_serve_with_one_line(shm_prefix: str, serves: list[Serve]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        serves.append(svc := Serve(shm_prefix, port=holder.getsockname()[1]))
        assert svc.wait() == 1  # before: the API restarted forever
    (line,) = svc.errors()
    assert f":{svc.port}" in line and "--port" in line


def test_a_child_that_never_starts_ends_serve(shm_prefix: str, serves: list[Serve]) -> None:
    socket_path = f"/dev/shm/{shm_prefix}_no_such_dir/dataplane.sock"
    serves.append(svc := Serve(shm_prefix, "--dataplane-socket", socket_path))
    assert svc.wait() == 1
    (line,) = svc.errors()
    assert "dataplane failed at start-up" in line and "No such file" in line


def test_a_crash_after_a_good_start_comes_back_at_once(shm_prefix: str,
                                                       serves: list[Serve]) -> None:
    serves.append(svc := Serve(shm_prefix))
    poll(svc.ready, START_DEADLINE, "/readyz")
    for kill in range(1, 4):  # before: 0.5, 1 and 2 s of backoff, growing to 15 s
        pid = poll(lambda: svc.status()["dataplane"]["pid"], START_DEADLINE, "its pid")
        os.kill(pid, signal.SIGKILL)
        poll(lambda: svc.ready() and svc.status()["dataplane"]["pid"] != pid, START_DEADLINE,
             "the data plane's restart")
        assert svc.status()["dataplane"]["restarts"] == kill
    restarts = [line for line in svc.lines if "dataplane exited" in line]
    assert len(restarts) == 3 and all("restarting in 0.0 s" in line for line in restarts)
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.wait() == 0


