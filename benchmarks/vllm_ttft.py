"""Time to first token of a real vLLM (CPU) with and without kvblend's connector.

A random-weight Llama of about 57 M parameters (hidden 512, 8 layers, GQA 8/2, head dim 64,
vocab 32,000, bfloat16) is saved with safetensors and served by vLLM for CPU in this process;
``kvblend serve --backend cpu`` runs beside it. TTFT is the wall time of a generation of one
token (prefill plus one sample), median of ``--repeats``, vLLM's own prefix caching off in every
engine (so what is reused comes from kvblend):

Every prompt has ``k`` x 512 + 64 tokens (``--docs`` gives the ``k``s).

- full: the engine without the connector;
- miss: the connector in prefix mode on prompts it has never seen (its lookup and the store of
  the prompt after the prefill are the overhead);
- repeat: prefix mode, the same prompt again (stored by an earlier run: kvblend as a cache
  shared by engines and restarts);
- permuted: blend mode, prompts made of 512-token documents in a new order each run plus a
  64-token question; every document was prefilled alone once and stored (naive reuse, K turned).

Usage::

    python benchmarks/vllm_ttft.py                    # 3, 4, 8 documents: 1,600 / 2,112 / 4,160 tokens
    python benchmarks/vllm_ttft.py --docs 4 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from blend_ttft import start_service  # noqa: E402
from dataplane.client import BlendClient  # noqa: E402
from shm.names import destroy  # noqa: E402

DOC = 512
QUESTION = 64


def save_model(path: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    print(f"# model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters",
          flush=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)


def engine(model: Path, url: str | None, mode: str = "prefix") -> Any:
    from vllm import LLM
    kw: dict[str, Any] = {}
    if url is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVBlendConnector",
            "kv_connector_module_path": "engine.vllm_connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": url, "mode": mode}}
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
               enforce_eager=True, kv_cache_memory_bytes=512 << 20,
               enable_prefix_caching=False, **kw)


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds to generate one token, prompt tokens kvblend gave)."""
    from vllm import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    took = time.perf_counter() - t0
    return took, int(((out.kv_transfer_params or {}).get("kvblend") or {}).get("loaded_tokens", 0))


def close(llm: Any) -> None:
    from engine.vllm_connector import shutdown_llm
    shutdown_llm(llm)
    del llm
    gc.collect()


def wait_stored(url: str, model: Path, prompt: list[int], chunks: int) -> None:
    """Until a lookup finds ``chunks`` chunks of ``prompt`` (stores finish after the prefill)."""
    with BlendClient(url) as client:
        deadline = time.monotonic() + 60
        while len(client.lookup(prompt, str(model)).matches) < chunks:
            if time.monotonic() > deadline:
                raise TimeoutError("the prompt's chunks were not stored within 60 s")
            time.sleep(0.01)  # a poll interval with a deadline


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", default="3,4,8", help="documents per prompt, one size per comma")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    counts = [int(x) for x in args.docs.split(",")]
    lengths = [k * DOC + QUESTION for k in counts]
    rng = np.random.default_rng(0)
    docs = [[int(t) for t in rng.integers(3, 32000, DOC)] for _ in range(max(counts))]
    question = [int(t) for t in rng.integers(3, 32000, QUESTION)]

    def permuted(n: int, run: int) -> list[int]:
        order = np.random.default_rng(100 + run).permutation(len(docs))[:(n - QUESTION) // DOC]
        return [t for i in order for t in docs[i]] + question

    def fresh(n: int, run: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(1000 * n + run).integers(3, 32000, n)]

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}", flush=True)
    prefix = f"kvvllm_{os.getpid()}"
    res: dict[tuple[str, int], list[float]] = {}
    loaded: dict[tuple[str, int], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        save_model(model)
        proc, url = start_service(prefix, "cpu", 1024)
        try:
            llm = engine(model, None)
            ttft(llm, fresh(512, 99))  # warm-up
            for n in lengths:
                res["full", n] = [ttft(llm, permuted(n, r))[0] for r in range(args.repeats)]
            close(llm)

            llm = engine(model, url, "prefix")
            ttft(llm, fresh(512, 98))
            for n in lengths:
                res["miss", n] = [ttft(llm, fresh(n, r))[0] for r in range(args.repeats)]
                wait_stored(url, model, fresh(n, 0), n // 256)
                runs = [ttft(llm, fresh(n, 0)) for _ in range(args.repeats)]
                res["repeat", n] = [t for t, _ in runs]
                loaded["repeat", n] = runs[0][1]
            close(llm)

            llm = engine(model, url, "blend")
            for d in docs:
                ttft(llm, d)
                wait_stored(url, model, d, DOC // 256)
            for n in lengths:
                runs = [ttft(llm, permuted(n, r)) for r in range(args.repeats)]
                res["permuted", n] = [t for t, _ in runs]
                loaded["permuted", n] = runs[0][1]
            close(llm)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            destroy(prefix)

    med = {k: 1e3 * statistics.median(v) for k, v in res.items()}
    print(f"\nTTFT, median of {args.repeats} (ms); x: full / case")
    print(f"{'tokens':>7} {'full':>8} {'miss':>8} {'x':>5} {'repeat':>8} {'loaded':>7} {'x':>5} "
          f"{'permuted':>9} {'loaded':>7} {'x':>5}")
    for n in lengths:
        f = med["full", n]
        print(f"{n:>7} {f:>8.1f} {med['miss', n]:>8.1f} {f / med['miss', n]:>5.2f} "
              f"{med['repeat', n]:>8.1f} {loaded['repeat', n]:>7} {f / med['repeat', n]:>5.2f} "
              f"{med['permuted', n]:>9.1f} {loaded['permuted', n]:>7} "
              f"{f / med['permuted', n]:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
