"""The data plane's settings: one declaration with its bounds, handed over whole as JSON in
``KVBLEND_DP_SETTINGS`` and read back once (that nothing else reads the environment is checked in
tests/test_seams.py); a bad one exits 2 naming the field, before anything is attached."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from kvblend.dataplane.__main__ import tuning
from kvblend.dataplane.calls import Tuning
from kvblend.dataplane.remoteurl import RemoteURL
from kvblend.dataplane.settings import ENV, DataPlaneSettings, RemoteSettings


def test_the_settings_round_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    remote = {"url": RemoteURL.parse("redis+cluster://a:7000,[::1]:7001"), "password": "pw",
              "key": "k3y-" * 8}
    sent = DataPlaneSettings.build(shm_prefix="p", first_mib=2, group_mib=0.5, remote=remote)
    env = sent.to_env()
    assert list(env) == [ENV]
    monkeypatch.setenv(ENV, env[ENV])
    got = DataPlaneSettings.from_env()
    assert got == sent and ENV not in os.environ  # read once, then dropped
    assert tuning(got) == Tuning(first_bytes=2 << 20, group_bytes=1 << 19)
    assert got.instance_lease_s == 30.0 and got.backend == "auto"
    assert isinstance(got.remote, RemoteSettings) and got.remote.password == "pw"
    assert got.remote.key == "k3y-" * 8
    assert "pw" not in repr(got) and "k3y" not in repr(got)  # secrets stay out of logs


@pytest.mark.parametrize("fields,why", [
    ({}, "shm_prefix"),
    ({"shm_prefix": "a/b"}, "shm_prefix"),
    ({"shm_prefix": "p", "group_mib": -1}, "group_mib"),
    ({"shm_prefix": "p", "max_connections": 1}, "max_connections"),
    ({"shm_prefix": "p", "chunk_size": 16}, "chunk_size"),  # the index's header says it
    ({"shm_prefix": "p", "remote": {"url": {"cluster": False, "tls": False,
                                            "nodes": [["h", 1]]}, "capacity": 100,
                                   "key": "k" * 16}},
     "power of two"),
    ({"shm_prefix": "p", "remote": {"url": {"cluster": False, "tls": False,
                                            "nodes": [["h", 1]]}}}, "key"),  # never unkeyed
    ({"shm_prefix": "p", "remote": {"url": {"cluster": False, "tls": False,
                                            "nodes": [["h", 1]]}, "key": "k" * 15}}, "key"),
])
def test_a_missing_or_bad_value_is_refused_naming_it(fields: dict, why: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=why):
        DataPlaneSettings.build(**fields)


@pytest.mark.slow
@pytest.mark.parametrize("env,argv,why", [
    (None, [], ENV),
    ('{"shm_prefix": "p", "max_instances": 0}', [], "max_instances"),
    ("{not json", [], ENV),
    ('{"shm_prefix": "p"}', ["--chunk-size", "16"], "no arguments"),
])
def test_the_process_exits_2_with_one_line(env: str | None, argv: list[str], why: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != ENV}
    if env is not None:
        environ[ENV] = env
    out = subprocess.run([sys.executable, "-m", "kvblend.dataplane", *argv], env=environ,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and why in out.stderr, out.stderr
