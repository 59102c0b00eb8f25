"""Tokens from files (``KVBLEND_API_TOKEN_FILE``, ``KVBLEND_ADMIN_TOKEN_FILE``), as Docker and
compose secrets hand them over (``/run/secrets/<name>``): the file's content less its line end,
used where neither the flag nor ``KVBLEND_<NAME>`` gives the token; a file that cannot be read
or is empty stops ``kvblend`` with one line naming the variable."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvblend.api.settings import FILE_SECRETS, Settings
from tests.harness import kvblend_argv


@pytest.fixture(autouse=True)
def _no_tokens_of_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FILE_SECRETS:
        monkeypatch.delenv(f"KVBLEND_{name.upper()}", raising=False)
        monkeypatch.delenv(f"KVBLEND_{name.upper()}_FILE", raising=False)


def secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o400)
    return path


def test_each_token_comes_from_its_file_less_the_line_end(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBLEND_API_TOKEN_FILE", str(secret(tmp_path, "api", "s3cret\n")))
    monkeypatch.setenv("KVBLEND_ADMIN_TOKEN_FILE", str(secret(tmp_path, "admin", "adm1n\r\n")))
    settings = Settings(host="0.0.0.0")  # a public bind: the file's token counts as a token
    assert settings.token() == "s3cret"
    assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "adm1n"
    # the API workers get the token itself, not the file (they may not see the same files)
    env = settings.to_env()
    assert env["KVBLEND_API_TOKEN"] == "s3cret" and not any(k.endswith("_FILE") for k in env)


def test_the_flag_and_the_variable_win_over_the_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBLEND_API_TOKEN_FILE", str(secret(tmp_path, "api", "from-file")))
    assert Settings(api_token="from-flag").token() == "from-flag"
    monkeypatch.setenv("KVBLEND_API_TOKEN", "from-variable")
    assert Settings().token() == "from-variable"


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_a_file_that_gives_no_token_fails_naming_the_variable(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "admin" if case == "missing" else secret(tmp_path, "admin", "\n")
    monkeypatch.setenv("KVBLEND_ADMIN_TOKEN_FILE", str(path))
    with pytest.raises(ValidationError) as caught:
        Settings()
    why = "No such file or directory" if case == "missing" else "is empty"
    assert f"KVBLEND_ADMIN_TOKEN_FILE={path}" in str(caught.value) and why in str(caught.value)


@pytest.mark.slow
def test_serve_stops_with_one_line_when_the_file_is_missing(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")},
           "KVBLEND_API_TOKEN_FILE": str(tmp_path / "gone")}
    out = subprocess.run([*kvblend_argv(), "serve"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"kvblend: Value error, KVBLEND_API_TOKEN_FILE={tmp_path / 'gone'}: "
        "No such file or directory"]
