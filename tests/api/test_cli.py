"""The ``kvblend`` command's own behaviour: --version, a closed stdout, the blame for a bad
``KVBLEND_*`` variable, and ``destroy`` against a real ``kvblend serve``."""

from __future__ import annotations

import os
import signal
import subprocess
from importlib.metadata import version

import pytest

from kvblend.api.cli import main
from kvblend.shm.names import leftovers
from tests.harness import START_DEADLINE, kvblend_argv, poll
from tests.test_supervisor import Serve


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kvblend {version('kvblend')}\n"


@pytest.mark.slow
def test_a_reader_that_left_is_no_error(shm_prefix: str) -> None:
    """``kvblend ... | head -1``: the pipe's reader is gone before anything is written. (Not
    ``--help``: argparse swallows that error itself, so it would pass without our handler.)"""
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run([*kvblend_argv(), "destroy", "--shm-prefix", shm_prefix], stdout=w,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (0, "")


def test_a_bad_variable_is_named_not_the_flag(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVBLEND_PORT", "eighty")
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvblend: KVBLEND_PORT: ") and "--port" not in err
    monkeypatch.delenv("KVBLEND_PORT")
    monkeypatch.setenv("KVBLEND_STORAGE_MB", "0")
    assert main(["serve", "--storage-mb", "-5"]) == 2  # the flag wins and is the one named
    assert capsys.readouterr().err.startswith("kvblend: --storage-mb: ")


@pytest.mark.slow
def test_destroy_refuses_while_serving_then_frees_the_cache(shm_prefix: str) -> None:
    svc = Serve(shm_prefix)
    try:
        poll(svc.ready, START_DEADLINE, "/readyz")
        busy = subprocess.run([*kvblend_argv(), "destroy", "--shm-prefix", shm_prefix],
                              capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1 and "stop it first" in busy.stderr
        assert svc.status()["storage"]  # untouched: still serving
    finally:
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.wait() == 0
    kept = leftovers(shm_prefix)
    assert kept  # a stopped service keeps its cache in shared memory
    done = subprocess.run([*kvblend_argv(), "destroy", "--shm-prefix", shm_prefix],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"removed {len(kept)} shared-memory names")
    freed = float(done.stdout.split(", ")[1].split()[0])
    assert freed >= 8  # --storage-mb 8 of slab at least
    assert leftovers(shm_prefix) == []


def test_serve_help_names_the_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "environment variable KVBLEND_<FLAG>" in out and "KVBLEND_REMOTE_PASSWORD" in out


def test_a_bad_log_level_says_the_allowed_values(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    allowed = "'critical', 'error', 'warning', 'info', 'debug'"  # before: a regex
    with pytest.raises(SystemExit) as done:
        main(["serve", "--log-level", "loud"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert allowed in err and "'trace'" in err and "^(" not in err
    monkeypatch.setenv("KVBLEND_LOG_LEVEL", "loud")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvblend: KVBLEND_LOG_LEVEL: ") and allowed in err and "^(" not in err


@pytest.mark.slow
def test_status_and_clear_say_which_token_they_need(shm_prefix: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """With both tokens set on the service: a 401 or 403 names the token the call needs and
    its flag and variable; ``clear`` takes ``--admin-token`` (or KVBLEND_ADMIN_TOKEN), and the
    service logs each clear."""
    api, admin = "t" * 32, "a" * 32
    svc = Serve(shm_prefix, token=api, env={"KVBLEND_ADMIN_TOKEN": admin})
    port = ["--port", str(svc.port)]
    try:
        poll(svc.ready, START_DEADLINE, "/readyz")
        assert main(["status", *port]) == 1  # before: a bare 401
        err = capsys.readouterr().err
        assert " 401 " in err and "none was given" in err
        assert "--api-token or set KVBLEND_API_TOKEN" in err
        assert main(["clear", *port, "--api-token", api]) == 1
        err = capsys.readouterr().err
        assert " 403 " in err and "the token from --api-token is not the admin token" in err
        assert "--admin-token or set KVBLEND_ADMIN_TOKEN" in err
        monkeypatch.setenv("KVBLEND_API_TOKEN", "wrong")
        assert main(["status", *port]) == 1
        assert "refused the token from KVBLEND_API_TOKEN" in capsys.readouterr().err
        monkeypatch.delenv("KVBLEND_API_TOKEN")
        assert main(["clear", *port, "--admin-token", admin]) == 0
        assert capsys.readouterr().out.startswith("removed 0 chunks")
        monkeypatch.setenv("KVBLEND_ADMIN_TOKEN", admin)
        assert main(["status", *port]) == 0  # the admin token is accepted where the API's is
        assert main(["clear", *port]) == 0
    finally:
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.wait() == 0
    cleared = [line for line in svc.lines if "cache cleared" in line]
    assert len(cleared) == 2 and all(" INFO api[" in line for line in cleared)
