"""numba's cache folder follows the kernels' sources, so no stale kernel survives an upgrade."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHOW = "import os, kvblend.shm.table; print(os.environ['NUMBA_CACHE_DIR'])"


def _cache_dir(root: Path, base: Path, *path: Path) -> Path:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(base),
           "PYTHONPATH": os.pathsep.join(map(str, (root, *path)))}
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, cwd=root, check=True,
                         capture_output=True, text=True, timeout=120)
    return Path(out.stdout.strip())


def test_a_change_to_any_kernel_source_gets_a_fresh_cache_folder(tmp_path: Path) -> None:
    """numba checks only a kernel's own file; ``shm.slab``'s cached kernels hold ``shm.table``'s
    code, so a change to table.py alone must not find them."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "shm", tree / "kvblend" / "shm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    base = tmp_path / "numba"
    first = _cache_dir(tree, base)
    assert first.parent == base and first == _cache_dir(tree, base)  # stable for one source
    with open(tree / "kvblend" / "shm" / "table.py", "a") as f:
        f.write("# changed\n")
    assert _cache_dir(tree, base).parent == base and _cache_dir(tree, base) != first


def test_another_numba_gets_another_folder(tmp_path: Path) -> None:
    """The project's venv and the vLLM venv pin different numbas and share one cache base: a
    kernel cached by one holds LLVM bitcode the other cannot parse, so each gets its own folder.
    Another numba is stood in for by distribution metadata ahead of the real one on the path."""
    fake = tmp_path / "fake"
    info = fake / "numba-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: numba\nVersion: 0.0.1\n")
    base = tmp_path / "numba"
    assert _cache_dir(ROOT, base, fake) != _cache_dir(ROOT, base)


def test_a_child_keeps_its_parents_folder(tmp_path: Path) -> None:
    """The service's children inherit the folder already chosen and do not nest it again."""
    chosen = _cache_dir(ROOT, tmp_path)
    assert _cache_dir(ROOT, chosen) == chosen


def test_without_a_folder_set_the_users_cache_is_used(tmp_path: Path) -> None:
    """``make serve``, a direct ``kvblend serve`` and the tests share one cache per user."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    assert Path(out.stdout.strip()).parent == tmp_path / "kvblend" / "numba"


def test_the_warm_up_logs_a_line_before_and_one_after(caplog: pytest.LogCaptureFixture,
                                                     shm_prefix: str) -> None:
    from kvblend.shm import _jit
    from kvblend.shm.warm import warm
    with caplog.at_level("INFO", logger="kvblend.kernels"):
        warm(shm_prefix)
    first, last = caplog.messages[0], caplog.messages[-1]
    assert ("loading kernels from" in first or "compiling kernels into" in first) and \
        _jit.CACHE_DIR in first
    assert re.fullmatch(r"kernels ready in \d+\.\d\d s", last) and len(caplog.messages) == 2
