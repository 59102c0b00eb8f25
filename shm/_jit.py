"""numba's cache folder, set before a kernel module first imports numba.

numba's ``cache=True`` needs a writable folder when kernels are defined (import time); without
one it fails. Unless the caller chose a folder, the user's cache is used. Only the kernel modules
(``index``, ``slab``, ``pins``, ``fingerprint``) import this, first: a process that only uses
``shm``'s plain types (an engine's client) neither loads numba nor has its environment changed.
"""

import os

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "kvblend", "numba"))
