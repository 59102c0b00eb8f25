"""Time to first token: blended prefill through kvblend against full prefill, and against its floor.

The model is Llama-3.1-8B's architecture in bf16 with random weights (timing needs no trained
weights; nothing is downloaded), run by the reference engine (``engine.blend``) with transformers'
SDPA attention. Documents of ``--doc-tokens`` are prefilled alone and stored in a
``kvblend serve`` started here on the same host; a prompt is as many documents as fit in N tokens
and a ``--question``-token question. Side by side in one run, medians of ``--iters``:

- full: the plain prefill of the prompt (no kvblend call);
- blend r: lookup + layer-wise retrieve with K turned to the prompt's positions + the check layers
  + selection + recompute of the top r of chunk tokens and the question, end to end; K turned by
  the engine on its own stream, by the data plane on retrieve, or (``--turn both``) each in turn;
- floor r: the same blend over KV already in the engine's buffer (no lookup, no retrieve): the
  compute a blend at r cannot avoid. ``blend / floor`` says how much of kvblend's work is hidden.

It also prints where a blend's time goes (lookup, waiting for loaded layers, selection, the rest).

Usage::

    python benchmarks/blend_ttft.py                                  # CUDA, 8k / 16k / 32k
    python benchmarks/blend_ttft.py --device cpu --model tiny --lengths 1024 --doc-tokens 256 \\
        --question 32 --iters 2                                     # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.engine.blend import FULL, BlendEngine, cacheblend  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from tests.harness import Service  # noqa: E402

LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MODELS = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "llama8b": (4096, 14336, 32, 32, 8, 128, 128256),
    "tiny": (64, 128, 4, 4, 2, 16, 4096),
}


def build_model(name: str, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, inter, layers, heads, kv, hd, vocab = MODELS[name]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=hd, rope_parameters=LLAMA_ROPE, max_position_embeddings=131072,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16, on the device: no fp32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def start_service(prefix: str, backend: str, storage_mb: int) -> Service:
    """``kvblend serve`` on a free loopback port; returns once ``/readyz`` answers."""
    return Service(prefix, "--backend", backend, "--storage-mb", str(storage_mb),
                   "--fingerprint-capacity", str(1 << 18), "--log-level", "warning",
                   defaults=(), start_deadline_s=600)


@contextlib.contextmanager
def served(prefix: str, backend: str, storage_mb: int) -> Iterator[str]:
    """``start_service`` for a block: its URL; stopped and its shared memory removed after."""
    svc = start_service(prefix, backend, storage_mb)
    try:
        yield svc.url
    finally:
        svc.stop(120)
        destroy(prefix)


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--question", type=int, default=256)
    p.add_argument("--ratios", default="0.15,0.05,0.30")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--storage-mb", type=int, default=0, help="default: what the documents need")
    p.add_argument("--turn", choices=("engine", "dataplane", "both"), default="both",
                   help="who turns loaded K: the engine on its own stream (its default on a GPU), "
                        "the data plane on retrieve, or both side by side")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    model = build_model(args.model, args.device)
    hidden, _, layers, _, kv, hd, vocab = MODELS[args.model]
    token_bytes = 2 * layers * kv * hd * 2
    storage = args.storage_mb or int(1.5 * max(lengths) * token_bytes / (1 << 20)) + 256
    prefix = f"kvttft_{os.getpid()}"
    svc = start_service(prefix, args.device, storage)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"# {device}; {args.model} ({layers} layers, {kv} kv heads x {hd}), bf16, SDPA; "
          f"documents of {args.doc_tokens} tokens + a {args.question}-token question; "
          f"medians of {args.iters}", flush=True)
    rng = np.random.default_rng(0)
    try:
        with BlendClient(svc.url) as client:
            engine = BlendEngine(model, client, "ttft", num_tokens=max(lengths) + 64)
            turns = ["engine", "dataplane"] if args.turn == "both" else [args.turn]
            print(f"{'tokens':>7} {'full ms':>8} {'r':>5} {'turn':>9} {'blend ms':>9} "
                  f"{'floor ms':>9} "
                  f"{'speedup':>8} {'floor x':>8} {'of floor':>8}  where a blend's time goes",
                  flush=True)
            for n in lengths:
                # documents of doc_tokens (the last one shorter) up to n - question tokens
                sizes = [args.doc_tokens] * ((n - args.question) // args.doc_tokens)
                if (n - args.question) % args.doc_tokens:
                    sizes.append((n - args.question) % args.doc_tokens)
                docs = [rng.integers(0, vocab, size) for size in sizes]
                prompt = np.concatenate(docs + [rng.integers(0, vocab, args.question)])
                for d in docs:
                    assert engine.precompute(d).ok
                spans = [(int(sum(sizes[:i])), size) for i, size in enumerate(sizes)]
                engine.prefill(prompt, FULL), engine.prefill(prompt, cacheblend(ratios[0]))  # warm
                full = median_ms([engine.prefill(prompt, FULL).times["total"]
                                  for _ in range(args.iters)])
                for r, turn in ((r, turn) for r in ratios for turn in turns):
                    engine.turn_here = turn == "engine"
                    engine.prefill(prompt, cacheblend(r))  # warm
                    runs = [engine.prefill(prompt, cacheblend(r)) for _ in range(args.iters)]
                    hits = int(runs[0].hit.sum())  # the documents' full chunks
                    blend = median_ms([x.times["total"] for x in runs])
                    floor = median_ms([engine.prefill(prompt, cacheblend(r), loaded=spans)
                                       .times["total"] for _ in range(args.iters)])
                    parts = {k: median_ms([x.times[k] for x in runs])
                             for k in ("lookup", "load_wait", "select")}
                    print(f"{len(prompt):>7} {full:>8.1f} {r:>5.2f} {turn:>9} {blend:>9.1f} "
                          f"{floor:>9.1f} "
                          f"{full / blend:>8.2f} {full / floor:>8.2f} "
                          f"{(full / blend) / (full / floor):>8.3f}  {hits} tokens reused; "
                          f"lookup {parts['lookup']:.1f}"
                          f", waiting for layers {parts['load_wait']:.1f}, selection "
                          f"{parts['select']:.1f}, compute and the rest "
                          f"{blend - sum(parts.values()):.1f} ms", flush=True)
            engine.close()
    finally:
        svc.stop(120)
        destroy(prefix)


if __name__ == "__main__":
    main()
