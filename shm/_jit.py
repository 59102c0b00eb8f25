"""numba's cache folder, set before a kernel module first imports numba.

numba's ``cache=True`` needs a writable folder when kernels are defined (import time); without
one it fails. Unless the caller chose a folder (``NUMBA_CACHE_DIR``), the user's cache is used:
``$XDG_CACHE_HOME/kvblend/numba`` or ``~/.cache/kvblend/numba``, one per user, so ``make serve``,
a direct ``kvblend serve`` and the tests all compile once and load afterwards. Only the kernel modules
(``index``, ``slab``, ``pins``, ``recovery``, ``table``, ``fpformat``, ``fpkernels``, ``probe``,
``cover``) import this, first: a process that only uses ``shm``'s plain types (an engine's
client) neither loads numba nor has its environment changed.

NOTE: numba keys a cached kernel by its own file's modification time only. A kernel compiled
together with a callee from another file (``shm.slab`` calling ``shm.index`` calling
``shm.table``) keeps the callee's old code when only the callee's file changes, so an upgrade could
run stale kernels against a new layout. So the folder gets a subfolder named by a digest of every
source file of ``shm``: any change to any of them starts from an empty cache (the old subfolders
are a few MiB each; deleting them is always safe). The digest also covers the versions of numba
and llvmlite: two environments sharing one folder (the project's venv and the vLLM venv, which
pins another numba) must not read each other's kernels, whose LLVM bitcode the other cannot
parse.
"""

import hashlib
import os
from importlib import metadata
from pathlib import Path


def _sources_digest() -> str:
    h = hashlib.blake2b(digest_size=8)
    for dist in ("numba", "llvmlite"):  # read without importing numba (not loaded yet)
        try:
            h.update(f"{dist}={metadata.version(dist)}\0".encode())
        except metadata.PackageNotFoundError:
            pass
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


_base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "kvblend", "numba")
if os.path.basename(_base) != (_digest := _sources_digest()):  # a child inherits it already set
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(_base, _digest)
CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]


def cached() -> bool:
    """True when the cache folder holds compiled kernels (numba's ``.nbi`` index files)."""
    return any(Path(CACHE_DIR).rglob("*.nbi"))
