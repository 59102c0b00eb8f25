"""The end of a test run names every cause of skipped tests once, with the files it skipped
(``tests/conftest.py``'s ``pytest_terminal_summary``): a real pytest run over a folder of tests
that skip for two causes, with that hook as its conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

needs_tool = pytest.mark.skipif(True, reason="sometool not installed (apt-get install sometool)")

@needs_tool
def test_one(): pass

@needs_tool
def test_two(): pass

def test_runs(): pass
'''


def test_the_summary_lists_each_cause_with_its_files(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_terminal_summary\n")
    (tmp_path / "test_tool.py").write_text(SUITE)
    (tmp_path / "test_gpu.py").write_text(
        "import pytest\npytest.skip('needs an NVIDIA GPU', allow_module_level=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "skipped suites, by cause" in line)
    assert lines[start + 1:start + 5] == [
        "2 skipped: sometool not installed (apt-get install sometool)",
        "    in test_tool.py (2)",
        "1 skipped: needs an NVIDIA GPU",
        "    in test_gpu.py (1)"]
