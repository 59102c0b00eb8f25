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
