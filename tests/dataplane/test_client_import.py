"""What an engine pays to import the client: torch, httpx, msgspec and the channel; not numba or
the store's kernels, and its environment is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHECK = """
import json, os, sys
env = dict(os.environ)
import kvblend.dataplane.client
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite") or m in (
    "kvblend.shm.store", "kvblend.shm.fingerprint", "kvblend.shm.index", "kvblend.shm.slab",
    "kvblend.shm.pins", "kvblend.shm.lookup", "kvblend.shm._jit"))
print(json.dumps({"heavy": heavy, "env_changed": dict(os.environ) != env}))
"""


def test_importing_the_client_loads_no_kernel_and_sets_no_variable() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"heavy": [], "env_changed": False}
