"""vLLM tests: skipped without vLLM (``make test-vllm`` installs it in its own venv)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the test's process
