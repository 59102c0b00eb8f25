"""One vLLM engine with the connector in its own process: ``python -m tests.vllm.run_engine MODEL
URL SEED LENGTH`` prints ``{"tokens": [...], "kvblend": {...}}`` of one greedy generation."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.vllm.engines import close, engine, generate, tokens  # noqa: E402


def main() -> None:
    model, url, seed, length = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = engine(model, url)
    out, params = generate(llm, tokens(length, seed))
    close(llm)
    print("RESULT " + json.dumps({"tokens": out, "kvblend": params}), flush=True)


if __name__ == "__main__":
    main()
