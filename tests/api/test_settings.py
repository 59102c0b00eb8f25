"""Settings that guard the trust boundary: no public bind without a token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvblend.api.settings import ENV_ONLY, MissingRemoteKey, Settings


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.org"])
def test_a_public_bind_needs_a_token(host: str) -> None:
    with pytest.raises(ValidationError, match="without an API token"):
        Settings(host=host)
    assert Settings(host=host, api_token="t").host == host
    assert Settings(host=host, insecure_no_token=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "localhost"])
def test_loopback_needs_none(host: str) -> None:
    assert Settings(host=host).api_token is None


@pytest.mark.slow
def test_serve_refuses_with_one_line_and_exit_code_2() -> None:
    out = subprocess.run([sys.executable, "-m", "kvblend.api.cli", "serve", "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--api-token" in out.stderr


@pytest.mark.slow
def test_a_remote_url_with_credentials_is_refused_without_echoing_them() -> None:
    out = subprocess.run([sys.executable, "-m", "kvblend.api.cli", "serve", "--remote",
                          "redis://admin:hunter2@cache:6379"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "KVBLEND_REMOTE_PASSWORD" in out.stderr and "hunter2" not in out.stderr
    for bad in ("http://cache:6379", "redis://a:1,b:2", "redis://cache:notaport"):
        with pytest.raises(ValidationError):
            Settings(remote=bad)
    assert Settings(remote="redis+cluster://a:7000,b:7001").remote
    for bad_capacity in (100, 32, 1 << 27):  # the shared table's size is a power of two in bounds
        with pytest.raises(ValidationError):
            Settings(remote_capacity=bad_capacity)
    assert Settings(remote_capacity=1 << 10).remote_capacity == 1024


def test_every_setting_is_a_serve_flag_and_in_the_readme() -> None:
    from pathlib import Path

    from kvblend.api.cli import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.dest for a in serve._actions if a.option_strings}
    assert set(Settings.model_fields) - set(ENV_ONLY) <= flags and not flags & set(ENV_ONLY)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [n for n in Settings.model_fields if n not in ENV_ONLY
            and f"`--{n.replace('_', '-')}`" not in readme] == []
    assert [n for n in ENV_ONLY if f"`KVBLEND_{n.upper()}`" not in readme] == []


def test_serve_flags_come_from_the_settings() -> None:
    """Each flag reads its field's type and shows its description and default; the client
    commands take only the flags that reach a service."""
    from kvblend.api.cli import build_parser
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    serve = {a.dest: a for a in commands["serve"]._actions if a.option_strings}
    for name, field in Settings.model_fields.items():
        assert field.description, name
        if name not in ENV_ONLY:
            assert serve[name].help.startswith(field.description), name
    assert serve["storage_mb"].help.endswith("(default 1024)") and serve["storage_mb"].type is int
    assert serve["ping_timeout_s"].help.endswith("(default 0.75)")
    assert serve["backend"].choices == ["auto", "cpu", "cuda"]
    assert "default" not in serve["api_token"].help and "default" not in serve["wipe"].help
    args = vars(parser.parse_args(["serve", "--wipe", "--backend", "cpu", "--stop-grace-s", "7",
                                   "--api-token", "t"]))
    assert args == {"command": "serve", "wipe": True, "backend": "cpu", "stop_grace_s": 7.0,
                    "api_token": "t"}
    status = {a.dest for a in commands["status"]._actions if a.option_strings}
    assert status == {"help", "host", "port", "api_token", "admin_token", "url", "json"}


@pytest.mark.parametrize("field,outside", [
    ("max_connections", 1), ("instance_lease_s", 0.5), ("max_instances", 4097),
    ("remote_streams", 257), ("remote_stream_len", 1000), ("dp_staging_mib", 0),
    ("dp_layer_dma_mib", -1),
    ("dataplane_socket", "/" + "s" * 107), ("shm_prefix", "a/b"),
])
def test_the_data_planes_bounds_hold_where_it_is_configured(field: str, outside: object) -> None:
    """The service's data-plane fields take their bounds from the data plane's declaration
    (``dataplane.settings``): a value the data plane would refuse fails at ``Settings``,
    naming the field, and what ``Settings`` takes the data plane takes."""
    with pytest.raises(ValidationError) as refused:
        Settings(**{field: outside})
    assert [e["loc"] for e in refused.value.errors()] == [(field,)]
    built = Settings(shm_prefix="p", remote="redis://cache:6379", remote_key="k" * 16,
                     dp_staging_mib=0.5, dp_layer_dma_mib=0).dataplane_settings()
    assert built.staging_mib == 0.5 and built.layer_dma_mib == 0 and built.remote is not None
    assert str(built.remote.url) == "redis://cache:6379" and built.remote.key == "k" * 16


def test_a_remote_needs_a_key_from_the_environment_or_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote without a key is refused where the data plane's settings are made (the API
    workers, which never get the key, still take their settings); the key comes from
    KVBLEND_REMOTE_KEY or the file KVBLEND_REMOTE_KEY_FILE names, and reaches the data plane
    only."""
    with pytest.raises(MissingRemoteKey, match="KVBLEND_REMOTE_KEY"):
        Settings(remote="redis://cache:6379").dataplane_settings()
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(remote="redis://cache:6379", remote_key="short")
    (tmp_path / "key").write_text("f" * 64 + "\n")
    monkeypatch.setenv("KVBLEND_REMOTE_KEY_FILE", str(tmp_path / "key"))
    settings = Settings(shm_prefix="p", remote="redis://cache:6379")
    remote = settings.dataplane_settings().remote
    assert remote is not None and remote.key == "f" * 64
    assert not any("f" * 64 in v for v in settings.to_env().values())
    assert "f" * 64 not in repr(settings) + repr(remote)


@pytest.mark.slow
@pytest.mark.parametrize("flags,named", [
    (["--max-connections", "1"], "--max-connections"),
    (["--remote", "redis://cache:6379", "--remote-capacity", "100"], "--remote-capacity"),
    (["--dp-first-mib", "-1"], "--dp-first-mib"),
    (["--remote", "redis://cache:6379"], "KVBLEND_REMOTE_KEY"),
])
def test_a_setting_the_data_plane_refuses_ends_serve_before_anything_starts(
        shm_prefix: str, flags: list[str], named: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvblend.api.cli", "serve", "--shm-prefix",
                          shm_prefix, *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and named in out.stderr
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)]
