"""The compose stack of ``deploy/`` without a Docker daemon: the compose file against the
compose-spec schema, Prometheus's scrape configuration by ``promtool``, and what neither checks:
the pieces name each other right (secret, mounts, service names, ports), no token is written down
or passed as a variable (kvblend reads it from its secret file), images are pinned by tag and
digest, /dev/shm holds the default cache, a /dev/shm too small for the settings stops ``up`` once
(shm-check, ``scripts/shm_check.py``, before kvblend starts) instead of a restart loop, and every
documented stop timeout outlasts the supervisor's worst-case drain."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvblend.api.settings import FILE_SECRETS, Settings
from kvblend.shm.fpformat import segment_bytes
from tests.api.test_docker import SMALL, instructions, worst_case_stop_s

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
SHM_CHECK = ROOT / "scripts" / "shm_check.py"
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
PROMETHEUS: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
PROVISIONING = DEPLOY / "grafana" / "provisioning"
(JOB,) = PROMETHEUS["scrape_configs"]


def default(value: str) -> str:
    """A compose value with its ``${VAR:-default}`` interpolations replaced by their defaults."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def seconds(duration: str) -> float:
    """A compose duration (``90s``, ``1m30s``, ``1h``) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?", duration)
    assert parts is not None and duration, f"not a duration: {duration!r}"
    h, m, s = (int(p or 0) for p in parts.groups())
    return 3600.0 * h + 60.0 * m + s


def size_bytes(size: str) -> int:
    """A compose byte size (``2gb``, ``512m``) in bytes."""
    parts = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower())
    assert parts is not None, f"not a size: {size!r}"
    return int(parts.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[parts.group(2)]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """The service's bind mounts: container path -> host path relative to the compose file."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            found[target] = source
    return found


@pytest.mark.slow
def test_the_compose_file_matches_the_compose_spec() -> None:
    checker = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    if checker is None:
        pytest.skip("check-jsonschema is not installed (in the test extra)")
    out = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    # promtool checks that the credentials file exists: point it at one here
    token = tmp_path / "token"
    token.write_text("t")
    text = (DEPLOY / "prometheus.yml").read_text()
    assert JOB["authorization"]["credentials_file"] in text
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace(JOB["authorization"]["credentials_file"], str(token)))
    out = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kvblend_is_built_from_this_dockerfile() -> None:
    build = SERVICES["kvblend"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT and (context / build.get("dockerfile", "Dockerfile")).is_file()


def test_no_token_or_password_is_written_down() -> None:
    kvblend, grafana = SERVICES["kvblend"], SERVICES["grafana"]
    assert not any(name in kvblend["environment"] for name in ("KVBLEND_API_TOKEN",
                                                                "KVBLEND_ADMIN_TOKEN"))
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${")
    assert COMPOSE["secrets"]["kvblend_api_token"] == {"environment": "KVBLEND_API_TOKEN"}
    assert "credentials" not in JOB["authorization"]


def test_kvblend_reads_its_token_from_the_secret_file() -> None:
    kvblend = SERVICES["kvblend"]
    (secret,) = kvblend["secrets"]
    assert secret["source"] == "kvblend_api_token"
    target = secret.get("target", secret["source"])
    variable = f"KVBLEND_{FILE_SECRETS[0].upper()}_FILE"  # the one Settings reads
    assert FILE_SECRETS[0] == "api_token"
    assert kvblend["environment"][variable] == f"/run/secrets/{target}"


def test_prometheus_scrapes_kvblend_with_the_token_secret() -> None:
    prometheus = SERVICES["prometheus"]
    (secret,) = prometheus["secrets"]
    name = secret["source"] if isinstance(secret, dict) else secret
    target = secret.get("target", name) if isinstance(secret, dict) else name
    assert name in COMPOSE["secrets"]
    assert JOB["authorization"]["credentials_file"] == f"/run/secrets/{target}"
    assert JOB["authorization"].get("type", "Bearer") == "Bearer"  # what /metrics takes
    config = next(a.split("=", 1)[1] for a in prometheus["command"]
                  if a.startswith("--config.file="))
    assert mounts(prometheus)[config] == "./prometheus.yml"
    (static,) = JOB["static_configs"]
    (host_port,) = static["targets"]
    host, port = host_port.split(":")
    published = [p.rsplit(":", 1)[-1] for p in SERVICES["kvblend"]["ports"]]
    assert host == "kvblend" and port in published
    assert port == str(Settings.model_fields["port"].default)
    assert JOB.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_provisions_prometheus_and_the_dashboards_folder() -> None:
    grafana = SERVICES["grafana"]
    assert mounts(grafana)["/etc/grafana/provisioning"] == "./grafana/provisioning"
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())[
        "datasources"]
    port = next(a for a in SERVICES["prometheus"]["ports"]).rsplit(":", 1)[-1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{port}"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "kvblend.yaml").read_text())[
        "providers"]
    assert provider["type"] == "file"
    folder = mounts(grafana)[provider["options"]["path"]]
    assert (DEPLOY / folder).resolve() == DEPLOY / "grafana" / "dashboards"
    assert (DEPLOY / folder).is_dir()


def test_third_party_images_are_pinned_by_tag_and_digest() -> None:
    for name, service in SERVICES.items():
        if "build" in service or service.get("pull_policy") == "never":
            continue
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)+@sha256:[0-9a-f]{64}", image), \
            f"{name}: {image} is not pinned by tag and digest"


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_dev_shm_holds_the_default_cache_and_fingerprint_index() -> None:
    kvblend = SERVICES["kvblend"]
    storage_mb = int(default(kvblend["environment"]["KVBLEND_STORAGE_MB"]))
    index = segment_bytes(Settings.model_fields["fingerprint_capacity"].default)
    assert size_bytes(default(kvblend["shm_size"])) > (storage_mb << 20) + index


def test_the_stop_grace_period_outlasts_the_drain() -> None:
    kvblend = SERVICES["kvblend"]
    assert kvblend["stop_signal"] == instructions("STOPSIGNAL")[0]
    assert seconds(kvblend["stop_grace_period"]) > worst_case_stop_s()


def test_every_documented_stop_timeout_outlasts_the_drain() -> None:
    worst = worst_case_stop_s()
    for doc in ("README.md", "Dockerfile"):
        timeouts = re.findall(r"--stop-timeout[ =](\d+)", (ROOT / doc).read_text())
        assert timeouts, f"{doc} does not say how to run with --stop-timeout"
        assert all(int(t) > worst for t in timeouts), f"{doc}: {timeouts} vs {worst} s"


# -- /dev/shm too small: one failure at start, not a restart loop ------------------------------


def test_shm_check_runs_once_before_kvblend_with_its_settings() -> None:
    kvblend, check = SERVICES["kvblend"], SERVICES["shm-check"]
    assert kvblend["depends_on"]["shm-check"] == {"condition": "service_completed_successfully"}
    assert check["restart"] == "no"
    for key in ("environment", "secrets", "shm_size"):
        assert check[key] == kvblend[key], key
    assert check["image"] == kvblend["image"] and check["pull_policy"] == "never"  # not pulled
    script = next(c.split()[1] for c in instructions("COPY") if "shm_check.py" in c)
    assert check["entrypoint"] == ["python3", script]
    assert (ROOT / next(c.split()[0] for c in instructions("COPY") if "shm_check.py" in c)) \
        == SHM_CHECK


def shm_check(**env: str) -> subprocess.CompletedProcess[str]:
    """scripts/shm_check.py as compose's shm-check runs it: the kvblend service's variables
    (the token as a secret file), ``env`` on top."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}
    settings = {k: default(v) for k, v in SERVICES["kvblend"]["environment"].items()
                if not k.endswith("_FILE")}
    return subprocess.run([sys.executable, str(SHM_CHECK)], capture_output=True, text=True,
                          env={**base, **settings, "KVBLEND_API_TOKEN": "t", **env}, timeout=120)


def dev_shm_mib() -> int:
    fs = os.statvfs("/dev/shm")
    return fs.f_blocks * fs.f_frsize >> 20


@pytest.mark.slow
def test_shm_check_passes_settings_that_fit() -> None:
    out = shm_check(**SMALL)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("shm-check: /dev/shm holds ")


@pytest.mark.slow
def test_shm_check_fails_a_storage_above_dev_shm_with_one_line_naming_shm_size() -> None:
    storage_mb = str(dev_shm_mib() + 64)
    out = shm_check(KVBLEND_STORAGE_MB=storage_mb)
    assert out.returncode == 78 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert "KVBLEND_SHM_SIZE" in line and "shm_size" in line and \
        f"KVBLEND_STORAGE_MB={storage_mb}" in line, line


def test_shm_check_counts_what_serve_creates_at_its_defaults() -> None:
    """The sum behind compose's default shm_size: more than the slab and the index together."""
    sys.path.insert(0, str(SHM_CHECK.parent))
    try:
        import shm_check as check
    finally:
        sys.path.remove(str(SHM_CHECK.parent))
    settings = Settings(storage_mb=int(default(SERVICES["kvblend"]["environment"]
                                               ["KVBLEND_STORAGE_MB"])))
    index = segment_bytes(settings.fingerprint_capacity)
    assert check.needed(settings) > (settings.storage_mb << 20) + index
    assert size_bytes(default(SERVICES["kvblend"]["shm_size"])) > check.needed(settings)
