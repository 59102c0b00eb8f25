"""Whether /dev/shm holds what ``kvblend serve`` creates there at start: compose's ``shm-check``.

    python3 /opt/kvblend/shm_check.py        (in the image; scripts/shm_check.py here)

Reads the service's settings as ``kvblend serve`` does (the ``KVBLEND_*`` variables, token files
included), adds up the segments it creates at start (the slab and the store's tables, the
fingerprint index, the event log, with a remote tier the table of remote chunks; each rounded up
to a page, plus ``SMALL_FILES`` for lock files, the socket and the state file) and compares the
sum with the size of the file system at /dev/shm. Engines' KV buffers need room on top of it.

Exit status 0: it fits, and one line says so; ``EX_CONFIG`` (78): it does not, and one line names
``KVBLEND_SHM_SIZE`` (compose's ``shm_size``) and ``KVBLEND_STORAGE_MB`` with the sizes; 2: a
setting is invalid (the line names it). Compose runs this once before kvblend starts
(``depends_on: condition: service_completed_successfully``): a /dev/shm too small stops
``docker compose up`` once, with that line, instead of a service that fails at start and is
restarted again and again.
"""

from __future__ import annotations

import os
import sys

from pydantic import ValidationError

from kvblend.api.settings import Settings
from kvblend.api.supervisor import store_config
from kvblend.shm import eventformat, fpformat, remotes, storefile

EX_CONFIG = 78
SHM = "/dev/shm"
MIB = 1 << 20
GIB = 1 << 30
#: lock files, the data plane's socket and state file: a few pages
SMALL_FILES = MIB


def needed(settings: Settings) -> int:
    """Bytes of /dev/shm that ``kvblend serve`` with ``settings`` fills at start."""
    cfg = store_config(settings)
    events = eventformat.layout(eventformat.DEFAULT_CAPACITY, eventformat.DEFAULT_SLOT_BYTES)[-1]
    segments = [cfg.slab_bytes, storefile.meta_size(cfg),
                fpformat.segment_bytes(settings.fingerprint_capacity), events]
    if settings.remote is not None:
        segments.append(remotes.segment_bytes(settings.remote_capacity))
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(-(-n // page) * page for n in segments) + SMALL_FILES


def main() -> int:
    try:
        settings = Settings()
    except ValidationError as exc:
        print("shm-check: " + "; ".join(e["msg"] for e in exc.errors()), file=sys.stderr)
        return 2
    need = needed(settings)
    fs = os.statvfs(SHM)
    size = fs.f_blocks * fs.f_frsize
    if need <= size:
        print(f"shm-check: {SHM} holds {size // MIB} MiB; kvblend fills {need // MIB} MiB of it "
              "at start, the rest is for engines' KV buffers")
        return 0
    print(f"shm-check: {SHM} holds {size // MIB} MiB but kvblend needs {-(-need // MIB)} MiB "
          f"(KVBLEND_STORAGE_MB={settings.storage_mb} plus the fingerprint index and tables): "
          f"raise KVBLEND_SHM_SIZE (compose's shm_size) to at least {-(-need // GIB)}gb plus "
          "room for engines' KV buffers, or lower KVBLEND_STORAGE_MB", file=sys.stderr)
    return EX_CONFIG


if __name__ == "__main__":
    sys.exit(main())
