"""``kvblend serve`` as a process: configuration failures end it with one line, crashes after a
good start come back at once, only a crash loop backs off."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any

import msgspec
import pytest

from kvblend.dataplane.settings import ENV, DataPlaneSettings
from tests.harness import START_DEADLINE, STOP_DEADLINE, Service, Services, free_port, poll
from tests.stderr_lines import collect_stderr

pytestmark = pytest.mark.slow

SMALL = ["--backend", "cpu", "--storage-mb", "8", "--page-mb", "1", "--min-slot-kb", "4",
         "--fingerprint-capacity", "4096", "--log-level", "info"]


class Serve(Service):
    """A ``kvblend serve`` with a small store whose stderr lines are collected as they come;
    returned at once, since some are meant to exit by themselves."""

    def __init__(self, prefix: str, *extra: str, port: int | None = None) -> None:
        super().__init__(prefix, *extra, port=port, defaults=SMALL, wait=False)

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        self.lines, self._reader = collect_stderr(proc)
        return proc

    def errors(self) -> list[str]:
        return [line for line in self.lines if " ERROR " in line]

    def wait(self) -> int:
        """The exit code of a service that ends by itself (or was signalled); every line read."""
        rc = self.proc.wait(START_DEADLINE)
        self._done()
        return rc

    def stop(self, deadline_s: float = STOP_DEADLINE) -> int:
        rc = super().stop(deadline_s)
        self._done()
        return rc

    def _done(self) -> None:
        self.http.close()
        self._reader.join(30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


def test_a_taken_port_ends_serve_with_one_line(services: Services) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        svc = services.add(Serve(services.prefix, port=holder.getsockname()[1]))
        assert svc.wait() == 1  # before: the API restarted forever
    (line,) = svc.errors()
    assert f":{svc.port}" in line and "--port" in line


def test_a_child_that_never_starts_ends_serve(services: Services) -> None:
    socket_path = f"/dev/shm/{services.prefix}_no_such_dir/dataplane.sock"
    svc = services.add(Serve(services.prefix, "--dataplane-socket", socket_path))
    assert svc.wait() == 1
    (line,) = svc.errors()
    assert "dataplane failed at start-up" in line and "No such file" in line


def test_a_crash_after_a_good_start_comes_back_at_once(services: Services) -> None:
    svc = services.add(Serve(services.prefix))
    poll(svc.ready, START_DEADLINE, "/readyz")
    for kill in range(1, 4):  # before: 0.5, 1 and 2 s of backoff, growing to 15 s
        pid = poll(lambda: svc.status()["dataplane"]["pid"], START_DEADLINE, "its pid")
        os.kill(pid, signal.SIGKILL)
        # a new data plane alive: a dead one's status has no pid, which differs from ``pid`` too
        poll(lambda: svc.ready() and svc.dataplane_pid() not in (None, pid), START_DEADLINE,
             "the data plane's restart")
        assert svc.status()["dataplane"]["restarts"] == kill
    restarts = [line for line in svc.lines if "dataplane exited" in line]
    assert len(restarts) == 3 and all("restarting in 0.0 s" in line for line in restarts)
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.wait() == 0




def environment_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def command_line_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]


def children_of(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def test_each_child_gets_only_its_own_settings_and_secrets(services: Services) -> None:
    """The data plane's environment holds its whole settings in one variable (the remote tier's
    credential inside) and no other ``KVBLEND_*`` one: no API or admin token. The API workers'
    holds the service's settings but no remote-tier credential. Neither command line holds a
    setting or a secret."""
    token, admin, password = "t" * 32, "a" * 32, "remote-secret-1"
    remote = f"redis://127.0.0.1:{free_port()}"  # nobody answers: a remote that is down only misses
    svc = services.start("--remote", remote, token=token,
                         env={"KVBLEND_ADMIN_TOKEN": admin, "KVBLEND_REMOTE_PASSWORD": password,
                              "KVBLEND_DP_FIRST_MIB": "8"})
    dataplane = svc.dataplane_pid()
    assert dataplane is not None
    api = [p for p in children_of(svc.proc.pid) if p != dataplane]
    assert len(api) == 1
    dp_env, api_env = environment_of(dataplane), environment_of(api[0])
    assert [k for k in dp_env if k.startswith("KVBLEND_")] == [ENV]
    assert not any(secret in value for value in dp_env.values() for secret in (token, admin))
    settings = msgspec.json.decode(dp_env[ENV], type=DataPlaneSettings)
    assert settings.shm_prefix == services.prefix and settings.first_mib == 8.0
    assert settings.remote is not None and str(settings.remote.url) == remote
    assert settings.remote.password == password
    assert api_env["KVBLEND_API_TOKEN"] == token and api_env["KVBLEND_ADMIN_TOKEN"] == admin
    assert api_env["KVBLEND_REMOTE"] == remote and ENV not in api_env
    assert not any(password in value for value in api_env.values())
    assert command_line_of(dataplane)[1:] == ["-m", "kvblend.dataplane"]
    for pid in (dataplane, api[0], svc.proc.pid):
        assert not any(s in arg for arg in command_line_of(pid) for s in (password, admin))
