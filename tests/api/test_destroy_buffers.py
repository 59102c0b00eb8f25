"""``kvblend destroy`` names the engine buffers it leaves (owner, size, why), and removes the
orphans among them only when asked."""

from __future__ import annotations

import subprocess

from kvblend.shm.segment import exists
from kvblend.shm.store import Store
from tests.dataplane.conftest import GEOMETRY
from tests.harness import kvblend_argv, serve_env
from tests.shm.test_kvbufs import _holder, _release, _segment


def _destroy(prefix: str, *flags: str) -> str:
    out = subprocess.run([*kvblend_argv(), "destroy", "--shm-prefix", prefix, *flags],
                         env=serve_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_destroy_reports_engine_buffers_and_removes_orphans_only_when_asked(
        shm_prefix: str) -> None:
    Store.open(shm_prefix, GEOMETRY).close()
    orphan, _ = _segment(shm_prefix, "ab" * 16)
    live, _ = _segment(shm_prefix, "cd" * 16)
    holder = _holder(live, "lock")
    try:
        text = _destroy(shm_prefix)
        assert f"left engine buffer {orphan} " in text and "--remove-engine-buffers" in text
        assert f"left engine buffer {live} " in text and "a live client holds it" in text
        assert exists(orphan) and exists(live)
        text = _destroy(shm_prefix, "--remove-engine-buffers")
        assert f"removed engine buffer {orphan} " in text
        assert f"left engine buffer {live} " in text
        assert not exists(orphan) and exists(live)
    finally:
        _release(holder)
