"""Time to first token and quality of a real vLLM (CPU) with kvblend's connector, on a real model.

vLLM for CPU serves SmolLM2-135M-Instruct (``tests/realmodel.py``; exported once to a float32
safetensors folder vLLM loads) in this process, ``kvblend serve --backend cpu`` beside it. Prompts
are cut from the held-out text: ``--docs`` documents of 256 tokens (one chunk each), consecutive
text, then the next 128 tokens, the continuation that is scored. Every document (and the system
prompt) was prefilled alone once and stored. Four shapes of the same documents:

    boundaries   the documents from position 0, on chunk boundaries
    preamble     5 tokens (unstored) before the documents
    separators   7 tokens (unstored) between every two documents
    system       a 300-token system prompt (stored alone: one full chunk and 44 tokens) first

Modes (vLLM's own prefix caching off in every engine, so what is reused comes from kvblend):

    full         vLLM without the connector
    prefix       the connector in prefix mode: prefix-exact chunks only
    naive        blend mode, ratio 0: the documents reused as stored (K turned), the gaps computed
    blend        blend mode, the default: 15 % of the chunk rows recomputed, gradual filtering
    blend100     blend mode, ratio 1: every row recomputed (a check: its NLL is full's)

TTFT: the wall time of generating one token, median over the prompts. NLL: the mean negative log
likelihood of the continuation (vLLM's prompt logprobs), and the share of the naive-to-full gap
each mode closes, with a 95 % bootstrap CI over the prompts. Blend runs before prefix mode: a
prefix-mode prompt is stored, and blend mode would then find the prompt's own chunks.

Usage (in a venv with ``pip install -e '.[vllm-bench]'``: vLLM, and what loads the GGUF)::

    python benchmarks/vllm_ttft.py                     # 6 documents, 10 prompts per shape
    python benchmarks/vllm_ttft.py --docs 4 --prompts 4 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
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
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from tests.harness import poll  # noqa: E402

DOC, CONTINUATION, PREAMBLE, SEPARATOR, SYSTEM = 256, 128, 5, 7, 300
SHAPES = ("boundaries", "preamble", "separators", "system")
MODES = {"full": None, "naive": ("blend", 0.0), "blend": ("blend", 0.15),
         "blend100": ("blend", 1.0), "prefix": ("prefix", None)}


def export_model(folder: Path) -> tuple[Path, np.ndarray]:
    """SmolLM2 as a safetensors folder vLLM loads (made once), and the held-out token ids."""
    from tests.realmodel import SMOLLM2, heldout_tokens, load
    lm, tok = load(torch.float32)
    out = folder / SMOLLM2.name / "vllm"
    if not (out / "config.json").is_file():
        lm.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    return out, heldout_tokens(tok)


def prompts(ids: np.ndarray, docs: int, count: int) -> tuple[dict[str, list], list[list[int]]]:
    """By shape, ``count`` prompts as (token ids, the continuation's first position); and every
    document and the system prompt, to store."""
    span = docs * DOC + CONTINUATION
    extra = ids[-(SYSTEM + PREAMBLE + SEPARATOR):].tolist()  # the text's end: not in any window
    system, pre, sep = extra[:SYSTEM], extra[SYSTEM:SYSTEM + PREAMBLE], extra[SYSTEM + PREAMBLE:]
    out: dict[str, list] = {s: [] for s in SHAPES}
    stored = [system]
    for i in range(count):
        w = ids[i * span:(i + 1) * span].tolist()
        ds, cont = [w[j * DOC:(j + 1) * DOC] for j in range(docs)], w[docs * DOC:]
        stored += ds
        body = [t for d in ds for t in d]
        joined = ds[0] + [t for d in ds[1:] for t in sep + d]
        for shape, head in (("boundaries", body), ("preamble", pre + body),
                            ("separators", joined), ("system", system + body)):
            out[shape].append((head + cont, len(head)))
    return out, stored


def engine(model: Path, url: str | None, mode: tuple[str, float | None] | None) -> Any:
    from vllm import LLM
    kw: dict[str, Any] = {}
    if mode is not None:
        extra: dict[str, Any] = {"url": url, "mode": mode[0]}
        if mode[1] is not None:
            extra["ratio"] = mode[1]
        kw["kv_transfer_config"] = {
            "kv_connector": "KVBlendConnector",
            "kv_connector_module_path": "kvblend.engine.vllm_connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=8192,
               enforce_eager=True, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False,
               **kw)


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds to generate one token, prompt tokens kvblend gave)."""
    from vllm import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    took = time.perf_counter() - t0
    return took, int(((out.kv_transfer_params or {}).get("kvblend") or {}).get("loaded_tokens", 0))


def nll(llm: Any, prompt: list[int], first: int) -> float:
    """Mean negative log likelihood of ``prompt[first + 1:]`` (vLLM's prompt logprobs).

    vLLM skips a connector for a request with prompt logprobs unless told otherwise; told, it
    gives the logprobs of the positions it computed, the last ones of the prompt. The token at
    ``first`` is not scored: its logits come from the position before, the claim's last."""
    from vllm import SamplingParams
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                      skip_reading_prefix_cache=False), use_tqdm=False)[0]
    lps = out.prompt_logprobs
    scored = range(first + 1, len(prompt))
    at = len(lps) - len(prompt)  # lps[p + at] is position p's
    return -float(np.mean([lps[p + at][prompt[p]].logprob for p in scored]))


def close(llm: Any) -> None:
    from kvblend.engine.vllm_connector import shutdown_llm
    shutdown_llm(llm)
    del llm
    gc.collect()


def store(llm: Any, url: str, model: Path, docs: list[list[int]]) -> None:
    """Prefill each document alone (prefix mode stores it) and wait until a lookup finds it."""
    with BlendClient(url) as client:
        for d in docs:
            ttft(llm, d)
            poll(lambda: client.lookup(d, str(model)).matches, 60, "a document to be stored",
                 every_s=0.01)


def closed_ci(naive: np.ndarray, full: np.ndarray, mode: np.ndarray, seed: int = 0
              ) -> tuple[float, float, float]:
    """Share of the naive-to-full gap ``mode`` closes (ratio of means), 95 % bootstrap CI."""
    def share(idx: np.ndarray) -> float:
        gap = naive[idx].mean() - full[idx].mean()
        return float((naive[idx].mean() - mode[idx].mean()) / gap) if gap else float("nan")
    rng = np.random.default_rng(seed)
    n = len(naive)
    boot = [share(rng.integers(0, n, n)) for _ in range(2000)]
    return share(np.arange(n)), float(np.nanpercentile(boot, 2.5)), float(np.nanpercentile(boot, 97.5))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.realmodel import cache_dir
    model, ids = export_model(cache_dir())
    by_shape, docs = prompts(ids, args.docs, args.prompts)
    res: dict[str, Any] = {"ttft": {}, "nll": {}, "loaded": {}}
    prefix = f"kvvllm_{os.getpid()}"
    svc = start_service(prefix, "cpu", 1024)
    url = svc.url
    try:
        llm = engine(model, url, MODES["prefix"])
        store(llm, url, model, docs)
        close(llm)
        for mode in ("naive", "blend", "blend100", "prefix", "full"):
            llm = engine(model, url, MODES[mode])
            ttft(llm, docs[0][:64])  # warm-up
            for shape in SHAPES:
                runs = [ttft(llm, p) for p, _ in by_shape[shape]]
                res["ttft"][mode, shape] = [t for t, _ in runs]
                res["loaded"][mode, shape] = [n for _, n in runs]
                res["nll"][mode, shape] = [nll(llm, p, f) for p, f in by_shape[shape]]
                print(f"# {mode:>8} {shape:>10}: TTFT {1e3 * statistics.median(res['ttft'][mode, shape]):7.1f} ms, "
                      f"NLL {np.mean(res['nll'][mode, shape]):.4f}", flush=True)
            close(llm)
    finally:
        svc.stop(120)
        destroy(prefix)
    return res


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{args.prompts} prompts per shape, {args.docs} documents of {DOC} tokens + "
          f"{CONTINUATION} scored; TTFT median (ms), x = full / mode; closed: share of the "
          "naive-to-full NLL gap, 95 % CI")
    modes = ("full", "prefix", "naive", "blend", "blend100")
    print(f"{'shape':>10} {'tokens':>6} " + " ".join(f"{m:>9}" for m in modes)
          + f" {'x blend':>8} {'loaded':>7} {'NLL full':>9} {'naive':>7} {'blend closed':>22} "
          f"{'blend100':>9}")
    for shape in SHAPES:
        med = {m: 1e3 * statistics.median(res["ttft"][m, shape]) for m in modes}
        nl = {m: np.asarray(res["nll"][m, shape]) for m in modes}
        share, lo, hi = closed_ci(nl["naive"], nl["full"], nl["blend"])
        s100 = closed_ci(nl["naive"], nl["full"], nl["blend100"])[0]
        tokens = args.docs * DOC + CONTINUATION + {"boundaries": 0, "preamble": PREAMBLE,
                                                   "separators": SEPARATOR * (args.docs - 1),
                                                   "system": SYSTEM}[shape]
        print(f"{shape:>10} {tokens:>6} " + " ".join(f"{med[m]:>9.1f}" for m in modes)
              + f" {med['full'] / med['blend']:>8.2f} {res['loaded']['blend', shape][0]:>7} "
              f"{nl['full'].mean():>9.4f} {nl['naive'].mean():>7.4f} "
              f"{share:>8.2f} [{lo:5.2f}, {hi:5.2f}] {s100:>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=6, help="documents per prompt")
    p.add_argument("--prompts", type=int, default=10, help="prompts per shape")
    p.add_argument("--json", help="write the raw numbers here")
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}", flush=True)
    res = run(args)
    report(res, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {k: {f"{m}/{s}": v for (m, s), v in d.items()} for k, d in res.items()}, indent=1))


if __name__ == "__main__":
    main()
