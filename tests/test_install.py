"""Where ``make`` takes torch from (``scripts/torch-index.sh``): PyTorch's CPU index on a machine
without an NVIDIA GPU when that index answers, else the default index with a line that says why;
a machine with a GPU keeps the default (CUDA) build. The index is a real HTTP server here, or a
closed port."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torch-index.sh"


class Index(http.server.BaseHTTPRequestHandler):
    """A package index's root page: 200 and a little HTML."""

    def do_GET(self) -> None:  # noqa: N802 - the handler's name is http.server's
        body = b"<html><body>torch</body></html>"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def index() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def closed_port() -> str:
    return f"http://127.0.0.1:{free_port()}/whl/cpu"


def run(url: str, *args: str, gpu: bool, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The script with a PATH that has (or lacks) an ``nvidia-smi``: a stub, or none at all (the
    real one's folder, where there is one, is left out)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    if gpu:
        (stubs / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (stubs / "nvidia-smi").chmod(0o755)
    real = shutil.which("nvidia-smi")
    path = [str(stubs)] + [d for d in os.environ["PATH"].split(os.pathsep)
                           if not real or Path(d) != Path(real).parent]
    return subprocess.run(["sh", str(SCRIPT), url, *args], capture_output=True, text=True,
                          env={**os.environ, "PATH": os.pathsep.join(path)}, timeout=60)


@pytest.mark.slow
def test_no_gpu_and_the_cpu_index_answers(index: str, tmp_path: Path) -> None:
    out = run(index, gpu=False, tmp_path=tmp_path)
    assert (out.stdout, out.stderr) == ("cpu\n", "")


@pytest.mark.slow
def test_no_gpu_and_no_cpu_index(tmp_path: Path) -> None:
    url = closed_port()
    out = run(url, gpu=False, tmp_path=tmp_path)
    assert out.stdout == "default\n" and out.stderr == f"{url} unreachable: torch from the default index\n"


@pytest.mark.slow
def test_a_gpu_keeps_the_default_index_unless_any_machine(index: str, tmp_path: Path) -> None:
    assert run(index, gpu=True, tmp_path=tmp_path).stdout == "default\n"
    assert run(index, "any", gpu=True, tmp_path=tmp_path).stdout == "cpu\n"


def test_the_makefile_installs_torch_through_the_script() -> None:
    makefile = (SCRIPT.parents[1] / "Makefile").read_text()
    assert "TORCH_INDEX = sh scripts/torch-index.sh $(TORCH_CPU_INDEX)" in makefile
    assert '"$$($(TORCH_INDEX))" = cpu' in makefile and '"$$($(TORCH_INDEX) any)" = cpu' in makefile
