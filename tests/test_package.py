"""What the distribution installs: one import namespace, ``kvblend``, and the old names for one more
release. The wheel is built here from the checkout (the project's own build backend, no index)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvblend.dataplane.client

ROOT = Path(__file__).resolve().parents[1]

#: the names an engine imports from the client: a change here is a change of the public contract
CLIENT_NAMES = ["BlendClient", "Transfer", "TransferResult", "LookupResult", "Match", "Namespace",
                "chunk_hashes"]


#: what the build reads (a copy of them is built, so that nothing is written into the checkout)
SOURCES = ["pyproject.toml", "setup.py", "README.md", "kvblend-legacy.pth", "api", "dataplane",
           "shm", "engine"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)], check=True, timeout=600,
                   capture_output=True)
    (found,) = out.glob("kvblend-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_installs_only_kvblend(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    dist = next(t for t in tops if t.endswith(".dist-info"))
    assert tops == {"kvblend", dist, "kvblend-legacy.pth"}
    for room in ("api", "api/routes", "dataplane", "shm", "engine"):
        assert f"kvblend/{room}/__init__.py" in names
    assert "kvblend/__init__.py" not in names  # a namespace: the rooms are the packages
    points = zipfile.ZipFile(wheel).read(f"{dist}/entry_points.txt").decode()
    assert "kvblend = kvblend.api.cli:main" in points
    assert "kvblend = kvblend.engine.vllm_plugin:register" in points


LEGACY = """
import json, site, sys, warnings
site.addsitedir(sys.argv[1])  # processes the wheel's .pth, as an interpreter start does
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dataplane.client
    import engine.blend
import kvblend.dataplane.client, kvblend.engine.blend
print(json.dumps({
    "same": [dataplane.client.BlendClient is kvblend.dataplane.client.BlendClient,
             engine.blend.BlendEngine is kvblend.engine.blend.BlendEngine],
    "warned": sorted(str(w.message) for w in caught if w.category is DeprecationWarning),
    "aliases": sorted(m for m in sys.modules if m.split(".")[0] in ("dataplane", "engine")
                      and sys.modules[m] is not sys.modules.get("kvblend." + m)),
}))
"""


@pytest.mark.slow
def test_the_old_names_import_the_new_modules_with_a_warning(wheel: Path, tmp_path: Path
                                                             ) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(target), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    out = subprocess.run([sys.executable, "-c", LEGACY, str(target)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["same"] == [True, True]
    assert "import 'dataplane.client' is deprecated: use 'kvblend.dataplane.client' (the old " \
           "name goes in the next release)" in got["warned"]
    assert any("'engine.blend'" in w for w in got["warned"])
    # every old name in sys.modules is the new module itself: no module runs twice
    assert got["aliases"] == []


@pytest.mark.slow
def test_without_the_hook_the_old_names_are_gone(tmp_path: Path) -> None:
    """A source checkout's folders are not importable under the old names by accident: the
    hook is what makes them work (a test run from the repository root would otherwise pass)."""
    out = subprocess.run([sys.executable, "-c", "import dataplane.client"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "No module named 'dataplane'" in out.stderr


def test_the_client_keeps_its_public_names() -> None:
    assert kvblend.dataplane.client.__all__ == CLIENT_NAMES
    client = kvblend.dataplane.client.BlendClient
    public = sorted(n for n in vars(client) if not n.startswith("_"))
    assert public == ["close", "cpu_kv_buffer", "cpu_paged_kv_cache", "list_instances", "lookup",
                      "prefetch", "register_kv_cache", "register_paged_kv_cache", "retrieve",
                      "share_cpu_tensor", "store_final", "store_pre_computed", "unregister"]
