"""A tiny random-weight Llama saved with safetensors, and vLLM engines over it."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 512
BLOCK = 128


def save_model(path: Path, layers: int = 2, hidden: int = 128, kv_heads: int = 2) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: tokens that depend on context
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def tokens(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, VOCAB, n)]


def engine(model: Path, url: str | None = None, mode: str = "prefix",
           prefix_caching: bool = False, llm: dict[str, Any] | None = None, **extra: Any) -> Any:
    """A vLLM engine over ``model``, with the (probed) connector to ``url`` in ``mode`` where
    given; ``llm``: arguments of ``vllm.LLM`` over the defaults; ``extra``: more of the
    connector's ``kv_connector_extra_config``."""
    import sys
    from vllm import LLM
    # vLLM 0.32's CPU worker scans every loaded module for Triton kernels and fails on llvmlite's
    # function wrappers: a test module that imported numba (the data plane's CPU kernels) first
    # breaks every engine after it with an AttributeError far from the cause
    assert "llvmlite.binding" not in sys.modules, \
        "numba was imported in this process before vLLM started: keep tests/vllm free of it"
    kw: dict[str, Any] = {}
    if url is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "ProbedConnector", "kv_connector_module_path": "tests.vllm.probe",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": url, "mode": mode, **extra}}
    kw = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 4096,
          "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "block_size": BLOCK,
          "enable_prefix_caching": prefix_caching, **kw, **(llm or {})}
    return LLM(model=str(model), **kw)


def generate(llm: Any, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], dict]:
    """Greedy tokens, and what the connector reported."""
    tokens, params, _ = generate_all(llm, [prompt], max_tokens)[0]
    return tokens, params


def generate_all(llm: Any, prompts: list[list[int]], max_tokens: int = 16, logprobs: int = 0
                 ) -> list[tuple[list[int], dict, dict[int, float]]]:
    """Per prompt, run together: greedy tokens, what the connector reported, and the first
    token's top ``logprobs`` (token -> log probability)."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs or None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), dict((o.kv_transfer_params or {}).get("kvblend", {})),
             {t: lp.logprob for t, lp in (o.outputs[0].logprobs or [{}])[0].items()})
            for o in outs]


def close(llm: Any) -> None:
    from kvblend.engine.vllm_connector import shutdown_llm
    shutdown_llm(llm)
    del llm
    gc.collect()
