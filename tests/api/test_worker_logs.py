"""An API worker process as uvicorn starts one (``--workers N`` spawns them): uvicorn configures its
logging from ``dataplane.logs.uvicorn_config``, then builds the app with ``app_from_env``; an
exception nobody catches, in any of its threads, must still be one record of the service's format."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import serve_env

WORKER = """
import logging.config, threading
from kvblend.dataplane.logs import uvicorn_config
logging.config.dictConfig(uvicorn_config("info", "json"))   # what uvicorn does in a worker
from kvblend.api.app import app_from_env
app_from_env()
t = threading.Thread(target=lambda: 1 / 0, name="doomed")
t.start()
t.join()
"""


def test_an_uncaught_exception_in_a_worker_is_one_json_record(shm_prefix: str) -> None:
    env = serve_env({"KVBLEND_SHM_PREFIX": shm_prefix, "KVBLEND_LOG_FORMAT": "json"})
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    crash = [r for r in records if "ZeroDivisionError" in r["message"]]
    assert len(crash) == 1 and crash[0]["level"] == "CRITICAL", done.stderr
    assert "doomed" in crash[0]["message"] and "exception" in crash[0]
    assert all(line.startswith("{") for line in done.stderr.splitlines()), done.stderr
