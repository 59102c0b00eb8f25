"""The data plane's settings: built once at start from flags, then ``KVBLEND_DP_*`` variables,
then defaults (that nothing else reads the environment is checked in tests/test_seams.py)."""

from __future__ import annotations

import pytest

from kvblend.dataplane.__main__ import parse_args
from kvblend.dataplane.transfer import Tuning

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
