"""``kvblend serve`` as a process: configuration failures end it with one line, crashes after a
good start come back at once, only a crash loop backs off; every process logs in the service's one
format (text or JSON), a clean stop is logged as clean."""

from __future__ import annotations

import json
import os
import re
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

    def __init__(self, prefix: str, *extra: str, port: int | None = None,
                 **options: Any) -> None:
        super().__init__(prefix, *extra, port=port, defaults=SMALL, wait=False, **options)

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        self.lines, self._reader = collect_stderr(proc)
        return proc

    def errors(self) -> list[str]:
        """The ERROR records: text lines, or the messages of JSON ones."""
        return [json.loads(line)["message"] if line.startswith("{") else line
                for line in self.lines
                if " ERROR " in line or line.startswith('{') and '"level": "ERROR"' in line]

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


@pytest.mark.parametrize("form", ["text", "json"])
def test_a_child_that_never_starts_ends_serve(services: Services, form: str) -> None:
    socket_path = f"/dev/shm/{services.prefix}_no_such_dir/dataplane.sock"
    svc = services.add(Serve(services.prefix, "--dataplane-socket", socket_path,
                             "--log-format", form))
    assert svc.wait() == 1
    (line,) = svc.errors()
    assert "dataplane failed at start-up" in line and "No such file" in line
    if form == "json":  # the child's crash too is one record, not a traceback's lines
        records = [json.loads(line) for line in svc.lines]
        (crash,) = [r for r in records if r["process"] == "dataplane" and r["level"] != "INFO"]
        assert crash["level"] == "CRITICAL" and crash["exception"].startswith("Traceback")


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
    credential and key inside) and no other ``KVBLEND_*`` one: no API or admin token. The API
    workers' holds the service's settings but no remote-tier credential or key. Neither command
    line holds a setting or a secret."""
    token, admin, password, key = "t" * 32, "a" * 32, "remote-secret-1", "remote-key-" * 4
    remote = f"redis://127.0.0.1:{free_port()}"  # nobody answers: a remote that is down only misses
    svc = services.start("--remote", remote, token=token,
                         env={"KVBLEND_ADMIN_TOKEN": admin, "KVBLEND_REMOTE_PASSWORD": password,
                              "KVBLEND_REMOTE_KEY": key, "KVBLEND_DP_FIRST_MIB": "8"})
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
    assert settings.remote.password == password and settings.remote.key == key
    assert api_env["KVBLEND_API_TOKEN"] == token and api_env["KVBLEND_ADMIN_TOKEN"] == admin
    assert api_env["KVBLEND_REMOTE"] == remote and ENV not in api_env
    assert not any(s in value for value in api_env.values() for s in (password, key))
    assert command_line_of(dataplane)[1:] == ["-m", "kvblend.dataplane"]
    for pid in (dataplane, api[0], svc.proc.pid):
        assert not any(s in arg for arg in command_line_of(pid) for s in (password, admin, key))


#: a text record's line: UTC time, level, process[pid], logger, message
TEXT_RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
                         r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (serve|api|dataplane)\[\d+\] [\w.]+: ")


def test_a_second_serve_names_the_first_and_a_clean_stop_logs_clean(services: Services) -> None:
    """Text records from every process, no access log unless asked (the test polls /readyz),
    a stop by SIGTERM logged as clean (before: "api stopped (exit code -15)")."""
    first = services.add(Serve(services.prefix))
    poll(first.ready, START_DEADLINE, "/readyz")
    second = services.add(Serve(services.prefix))
    assert second.wait() == 1
    (line,) = second.errors()
    assert f"another kvblend serve runs on prefix {services.prefix!r} (pid {first.proc.pid}, " \
           f"API on port {first.port})" in line
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait() == 0
    assert [line for line in first.lines if not TEXT_RECORD.match(line)] == []
    assert {TEXT_RECORD.match(line)[2] for line in first.lines} == {"serve", "api", "dataplane"}
    assert not [line for line in first.lines if "/readyz" in line or "exit code" in line]
    assert {"api stopped cleanly", "dataplane stopped cleanly"} <= {
        line.split(": ", 1)[1] for line in first.lines}


def test_json_logs_one_record_per_line_from_every_process(services: Services) -> None:
    """``--log-format json``: every stderr line of the service is one JSON record (the
    supervisor's, the API's, uvicorn's access log with ``--access-log``, the data plane's)."""
    svc = services.add(Serve(services.prefix, "--log-format", "json", "--access-log"))
    poll(svc.ready, START_DEADLINE, "/readyz")
    r = svc.http.get("/v1/status", headers={"x-request-id": "status-probe-1"})
    assert r.status_code == 200 and r.json()["shm_prefix"] == services.prefix
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.wait() == 0
    records = [json.loads(line) for line in svc.lines]
    assert all(list(r)[:6] == ["time", "level", "process", "pid", "logger", "message"]
               for r in records)
    assert {r["process"] for r in records} == {"serve", "api", "dataplane"}
    assert [r["level"] for r in records if r["level"] not in ("INFO", "DEBUG")] == []
    access = [(r["method"], r["path"], r["status"], r["request_id"]) for r in records
              if r["logger"] == "uvicorn.access"]
    assert ("GET", "/v1/status", 200, "status-probe-1") in access  # the request's own id
    assert {"api stopped cleanly", "dataplane stopped cleanly"} <= {r["message"] for r in records}
