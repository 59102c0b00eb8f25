"""KVBlendConnector in a real vLLM (CPU) with a real ``kvblend serve``: prefix reuse within and
across engines, blended documents at new positions, and a chunk evicted before its load."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests")

from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402
from tests.harness import Service, Services, poll  # noqa: E402
from tests.vllm import probe  # noqa: E402
from tests.vllm.engines import BLOCK, close, engine, generate, save_model, tokens  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines beside a kvblend serve

CHUNK = 256  # kvblend serve's default chunk size


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def service(services: Services) -> Service:
    return services.start()


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    probe.SEEN.update(caches=None, loads=[], errors=set())


(DOC_A, DOC_B, DOC_C), TAIL = (tokens(CHUNK, s) for s in (21, 22, 23)), tokens(50, 24)
PROMPTS = {1: tokens(700, 1), 2: tokens(600, 2), "AB": DOC_A + DOC_B + TAIL,
           "CB": DOC_C + DOC_B + TAIL}


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[dict]:
    """Greedy tokens of vLLM without the connector, by prompt."""
    llm = engine(model)
    yield {name: generate(llm, prompt)[0] for name, prompt in PROMPTS.items()}
    close(llm)


def scramble_cache() -> None:
    """Random bytes in every block of vLLM's cache: what a request reads it loaded or computed."""
    g = torch.Generator().manual_seed(5)
    for layer in probe.SEEN["caches"]:
        layer.copy_(torch.randn(layer.shape, generator=g))


def wait_stored(service: Service, model: Path, prompt: list[int], chunks: int) -> None:
    """Until a lookup finds the prompt's first ``chunks`` chunks: a prompt's store runs in the
    data plane after its prefill, so the next request may come before it finished."""
    with BlendClient(service.url) as client:
        poll(lambda: len(client.lookup(prompt, str(model)).matches) >= chunks, 60, "the store")


def test_a_repeated_prompt_loads_from_kvblend_and_generates_the_same(
        model: Path, service: Service, reference: dict) -> None:
    llm = engine(model, service.url, "prefix")
    try:
        first, p1 = generate(llm, tokens(700, 1))
        assert p1 == {"mode": "prefix", "loaded_tokens": 0, "stored": True}
        wait_stored(service, model, tokens(700, 1), 2)
        scramble_cache()
        second, p2 = generate(llm, tokens(700, 1))
        assert p2["loaded_tokens"] == 2 * CHUNK
        assert [pos for _, _, pos in probe.SEEN["loads"]] == [[0, CHUNK]]
        assert not probe.SEEN["errors"]
        assert first == second == reference[1]
    finally:
        close(llm)


def test_prefix_mode_loads_only_chunks_computed_after_the_same_prefix(
        model: Path, service: Service, reference: dict) -> None:
    """B stored after A, then after C: the lookup of A+B finds B's newest entry (after C); prefix
    mode loads B by A+B's own key, the KV a full prefill of A+B computes."""
    llm = engine(model, service.url, "prefix")
    try:
        for name in ("AB", "CB"):
            assert generate(llm, PROMPTS[name]) == (reference[name], {
                "mode": "prefix", "loaded_tokens": 0, "stored": True})
            wait_stored(service, model, PROMPTS[name], 2)
        ab_keys = chunk_hashes(Namespace(str(model)), PROMPTS["AB"], CHUNK)
        with BlendClient(service.url) as client:  # the case this test is about
            found = client.lookup(PROMPTS["AB"], str(model)).matches
        assert [bytes(m.chunk_hash) == k for m, k in zip(found, ab_keys)] == [True, False]
        scramble_cache()
        out, params = generate(llm, PROMPTS["AB"])
        assert params["loaded_tokens"] == 2 * CHUNK and not probe.SEEN["errors"]
        assert out == reference["AB"]
        (_, blocks, starts), = probe.SEEN["loads"]
        assert starts == [0, CHUNK]
        for layer in (0, 1):  # layer 1's K of B depends on what came before B
            torch.testing.assert_close(_cache_k(probe.SEEN["caches"][layer], blocks, 0, 2 * CHUNK),
                                       _full_k(model, PROMPTS["AB"], layer)[:, :2 * CHUNK],
                                       rtol=1e-4, atol=1e-4)
    finally:
        close(llm)


def _run_engine(model: Path, url: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.run_engine", str(model), url, "2",
                           "600"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


def test_b_a_second_engine_process_reuses_what_the_first_stored(
        model: Path, service: Service, reference: dict) -> None:
    one = _run_engine(model, service.url)  # its store finished before it shut down
    two = _run_engine(model, service.url)
    assert one["kvblend"] == {"mode": "prefix", "loaded_tokens": 0, "stored": True}
    assert two["kvblend"]["loaded_tokens"] == 2 * CHUNK
    assert one["tokens"] == two["tokens"] == reference[2]


def _full_k(model: Path, ids: list[int], layer: int) -> torch.Tensor:
    """K (after the rotary embedding) of a full prefill in transformers: ``[kv_heads, n, dim]``."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    return cache.layers[layer].keys[0]


def _cache_k(layer: torch.Tensor, blocks: list[int], start: int, n: int) -> torch.Tensor:
    """K of positions ``start..start+n`` in vLLM's CPU layer ``[B, H, S, 2*D]`` (K of a block
    and head stored transposed ``[D, S]``): ``[H, n, D]``."""
    nb, H, S, D2 = layer.shape
    k = layer.reshape(nb, H, 2 * S * D2 // 2)[:, :, :S * D2 // 2].reshape(nb, H, D2 // 2, S)
    pos = torch.arange(start, start + n)
    b = torch.tensor(blocks)[pos // S]
    return k[b, :, :, pos % S].permute(1, 0, 2)


def test_c_blend_mode_loads_documents_at_new_positions_with_k_turned(
        model: Path, service: Service) -> None:
    d1, d2, question = tokens(CHUNK, 11), tokens(CHUNK, 12), tokens(100, 13)
    llm = engine(model, service.url, "blend")
    try:
        for doc in (d1, d2):  # each prefilled alone: stored at positions 0..255
            assert generate(llm, doc, 1)[1]["stored"]
            wait_stored(service, model, doc, 1)
        prompt = d2 + d1 + question
        _, params = generate(llm, prompt, 1)
        assert params == {"mode": "blend", "loaded_tokens": 2 * CHUNK, "stored": False}
        (_, blocks, starts), = probe.SEEN["loads"]
        assert starts == [0, CHUNK]
        got = _cache_k(probe.SEEN["caches"][0], blocks, 0, 2 * CHUNK)
        want = _full_k(model, prompt, 0)[:, :2 * CHUNK]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # d1's KV as stored (positions 0..) is not what position 256.. needs: the turn mattered
        assert (_full_k(model, d1, 0) - want[:, CHUNK:]).abs().max() > 0.1
    finally:
        close(llm)


def test_d_a_chunk_evicted_between_lookup_and_load_is_recomputed(
        model: Path, service: Service, reference: dict) -> None:
    llm = engine(model, service.url, "prefix", evict=True)
    try:
        generate(llm, tokens(700, 1))
        wait_stored(service, model, tokens(700, 1), 2)
        scramble_cache()
        out, params = generate(llm, tokens(700, 1))  # clears kvblend between lookup and load
        assert params["loaded_tokens"] == 2 * CHUNK  # claimed, then not found
        assert len(probe.SEEN["loads"]) == 1
        _, blocks, _ = probe.SEEN["loads"][0]
        assert probe.SEEN["errors"] == set(blocks[:2 * CHUNK // BLOCK])
        assert out == reference[1]
    finally:
        close(llm)
