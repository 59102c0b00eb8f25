"""vLLM tests: skipped without vLLM (``make test-vllm`` installs it in its own venv)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the test's process
pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests")
