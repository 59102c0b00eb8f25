"""What can be checked of the Dockerfile without a Docker daemon: what it copies exists, what it
runs exists, and its health check probes the route that stays open."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from api.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.strip().upper().startswith(name + " ")]


def test_copied_paths_exist_and_are_not_ignored() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for copy in instructions("COPY"):
        for src in copy.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert src.rstrip("/") not in ignored, f"COPY {src} is excluded by .dockerignore"


def test_entrypoint_is_the_console_script_and_cmd_a_subcommand() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert instructions("ENTRYPOINT") == ['["kvblend"]'] and "kvblend" in scripts
    module, func = scripts["kvblend"].split(":")
    assert func == "main" and (ROOT / (module.replace(".", "/") + ".py")).exists()
    cmd = instructions("CMD")[0]
    build_parser().parse_args(re.findall(r'"([^"]+)"', cmd))  # exits on an unknown subcommand


def test_every_package_is_copied() -> None:
    copied = {c.split()[0].rstrip("/") for c in instructions("COPY")}
    for pkg in ("api", "dataplane", "shm"):
        assert pkg in copied


def test_healthcheck_probes_healthz() -> None:
    (check,) = instructions("HEALTHCHECK")
    assert "/healthz" in check and "8780" in check
