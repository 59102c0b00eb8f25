"""The data plane's settings: built once at start from flags, then ``KVBLEND_DP_*`` variables,
then defaults; nothing else in the packages reads configuration from the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dataplane.__main__ import parse_args
from dataplane.transfer import Tuning

ROOT = Path(__file__).resolve().parents[2]


def test_flags_win_over_variables_which_win_over_defaults(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("KVBLEND_DP_SHM_PREFIX", "from-env")
    monkeypatch.setenv("KVBLEND_DP_FIRST_MIB", "2")
    s = parse_args(["--chunk-size", "16", "--group-mib", "0.5"])
    assert (s.shm_prefix, s.chunk_size) == ("from-env", 16)
    assert s.tuning() == Tuning(first_bytes=2 << 20, group_bytes=1 << 19)
    assert s.limits().lease_s == 30.0 and s.backend == "auto"
    s = parse_args(["--shm-prefix", "from-flag", "--chunk-size", "16", "--first-mib", "1"])
    assert s.shm_prefix == "from-flag" and s.tuning().first_bytes == 1 << 20


@pytest.mark.parametrize("argv,why", [
    (["--chunk-size", "16"], "shm_prefix"),
    (["--shm-prefix", "p", "--chunk-size", "0"], "chunk_size"),
    (["--shm-prefix", "p", "--chunk-size", "16", "--group-mib", "-1"], "group_mib"),
])
def test_a_missing_or_bad_value_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], why: str) -> None:
    monkeypatch.delenv("KVBLEND_DP_SHM_PREFIX", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and why in capsys.readouterr().err


# where the environment is touched on purpose, and why it is not configuration
ALLOWED = {
    "api/settings.py": "the API's settings",
    "dataplane/settings.py": "the data plane's settings (through pydantic-settings)",
    "api/supervisor.py": "passes its environment on to the children it starts",
    "shm/_jit.py": "gives numba a cache folder before any kernel is defined",
}


def test_only_settings_modules_read_the_environment() -> None:
    readers = sorted(str(p.relative_to(ROOT)) for pkg in ("shm", "api", "dataplane")
                     for p in (ROOT / pkg).rglob("*.py")
                     if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text()))
    assert set(readers) <= set(ALLOWED), readers
