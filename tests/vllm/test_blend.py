"""CacheBlend inside a real vLLM (CPU) with a real ``kvblend serve``: blend mode claims every
stored chunk through gaps, recomputes with vLLM's own modules (100 %: vLLM's own output; the
default share: the reference engine's rows and logits), counts in vLLM's metrics, and survives
what a service meets: kvblend down at start, chunks evicted before the load, preemption."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests")

from kvblend.dataplane.client import BlendClient  # noqa: E402
from tests.harness import Service, free_port, poll, remove_prefix, unique_prefix  # noqa: E402
from tests.vllm import probe  # noqa: E402
from tests.vllm.engines import close, engine, generate, generate_all, save_model, tokens  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines beside a kvblend serve

CHUNK = 256  # kvblend serve's default chunk size
D1, D2, SYSTEM, QUESTION = tokens(CHUNK, 11), tokens(CHUNK, 12), tokens(300, 14), tokens(64, 13)
# (prompt, the claim, where the chunks sit): the shapes a RAG prompt takes
SHAPES = {
    "on chunk boundaries": (D2 + D1 + QUESTION, 512, [0, 256]),
    "a 5-token preamble": (tokens(5, 15) + D2 + D1 + QUESTION, 517, [5, 261]),
    "7 tokens between the documents": (D2 + tokens(7, 16) + D1 + QUESTION, 519, [0, 263]),
    "a stored 300-token system prompt": (SYSTEM + D1 + D2 + QUESTION, 812, [0, 300, 556]),
}
LOGPROBS = 5
TOLERANCE = 2e-3  # float32 through two attention implementations


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers: the default selects after layers 1 and 2, and layers 2 and 3 use what it kept."""
    return save_model(tmp_path_factory.mktemp("tiny-llama"), layers=4)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    svc = Service(unique_prefix())
    yield svc
    svc.stop()
    remove_prefix(svc.prefix)


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    probe.SEEN.update(caches=None, loads=[], errors=set(), blends=[], preempted=[])


@pytest.fixture(scope="module")
def alone(model: Path) -> Iterator[dict]:
    """vLLM without the connector, by shape: (greedy tokens, first token's top logprobs)."""
    llm = engine(model)
    got = generate_all(llm, [p for p, _, _ in SHAPES.values()], 8, LOGPROBS)
    yield {name: (t, lp) for name, (t, _, lp) in zip(SHAPES, got)}
    close(llm)


@pytest.fixture(scope="module")
def stored(model: Path, service: Service) -> None:
    """The documents and the system prompt, each prefilled alone by vLLM and stored."""
    llm = engine(model, service.url, "prefix")
    try:
        for doc in (D1, D2, SYSTEM):
            assert generate(llm, doc, 1)[1]["stored"]
            with BlendClient(service.url) as client:
                poll(lambda: len(client.lookup(doc, str(model)).matches) >= 1, 60, "the store")
    finally:
        close(llm)


def blended(model: Path, service: Service, **extra: object) -> dict:
    """Every shape through a blend-mode engine: by shape (tokens, kvblend's report, logprobs,
    the blend probed)."""
    llm = engine(model, service.url, "blend", **extra)
    try:
        out = {}
        for name, (prompt, _, _) in SHAPES.items():
            probe.SEEN["blends"] = []
            tokens_, params, lp = generate_all(llm, [prompt], 8, LOGPROBS)[0]
            out[name] = (tokens_, params, lp, list(probe.SEEN["blends"]))
        return out
    finally:
        close(llm)


def close_logprobs(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest difference of two top-k logprob maps over their common tokens (inf where the
    top token differs)."""
    if max(a, key=a.get) != max(b, key=b.get):  # type: ignore[arg-type]
        return math.inf
    return max(abs(a[t] - b[t]) for t in set(a) & set(b))


def test_blend_mode_claims_every_stored_chunk_and_full_recompute_is_vllm_alone(
        model: Path, service: Service, stored: None, alone: dict) -> None:
    got = blended(model, service, ratio=1.0)
    for name, (prompt, claim, starts) in SHAPES.items():
        tokens_, params, lp, blends = got[name]
        assert params == {"mode": "blend", "loaded_tokens": claim, "stored": False}, name
        (_, blend_claim, gaps, done), = blends
        assert blend_claim == claim and done is not None and not done.late, name
        ends = [0] + [s + CHUNK for s in starts]
        assert gaps == [(a, b) for a, b in zip(ends, starts + [claim]) if a < b], name
        assert tokens_ == alone[name][0], name
        assert close_logprobs(lp, alone[name][1]) < TOLERANCE, name
    assert probe.SEEN["errors"] == set()


def reference_engine(model: Path, service: Service) -> tuple[object, BlendClient]:
    from transformers import LlamaForCausalLM

    from kvblend.engine.blend import BlendEngine
    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    client = BlendClient(service.url)
    return BlendEngine(hf, client, str(model), num_tokens=1024), client


def test_the_default_selection_is_the_reference_engine_s(
        model: Path, service: Service, stored: None, alone: dict) -> None:
    from kvblend.engine.blend import DEFAULT, NAIVE
    got = blended(model, service)  # the default: 15 %, gradual filtering
    naive = blended(model, service, ratio=0.0)
    ref, client = reference_engine(model, service)
    try:
        for name, (prompt, claim, _) in SHAPES.items():
            p = ref.prefill(prompt, DEFAULT)  # type: ignore[attr-defined]
            (_, _, _, done), = got[name][3]
            assert done.rows.tolist() == [r for r in p.positions.tolist() if r < claim], name
            want = torch.log_softmax(p.logits[-1], -1)
            ref_lp = {t: float(want[t]) for t in got[name][2]}
            assert close_logprobs(got[name][2], ref_lp) < TOLERANCE, name
            # the test tells selections apart: naive reuse is far off both
            n = ref.prefill(prompt, NAIVE)  # type: ignore[attr-defined]
            naive_ref = torch.log_softmax(n.logits[-1], -1)
            assert close_logprobs(naive[name][2], {t: float(naive_ref[t])
                                                   for t in naive[name][2]}) < TOLERANCE, name
            assert close_logprobs(got[name][2], naive[name][2]) > 10 * TOLERANCE, name
    finally:
        ref.close()  # type: ignore[attr-defined]
        client.close()


def test_the_connector_s_counters_are_in_vllm_s_metrics(
        model: Path, service: Service, stored: None) -> None:
    prompt, claim, _ = SHAPES["a 5-token preamble"]
    llm = engine(model, service.url, "blend", llm={"disable_log_stats": False})
    try:
        generate(llm, prompt, 4)
        got = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:kvblend_")}
    finally:
        close(llm)
    chunk_rows = claim - 5
    # layers 0 and 1 compute every row; layer 2 the gap and 30 % of the chunk rows, layer 3 15 %
    rows = 2 * claim + (5 + math.ceil(0.30 * chunk_rows)) + (5 + math.ceil(0.15 * chunk_rows))
    assert got == {"vllm:kvblend_loads": 1, "vllm:kvblend_loaded_tokens": claim,
                   "vllm:kvblend_gap_tokens": 5, "vllm:kvblend_recomputed_rows": rows,
                   "vllm:kvblend_blend_layers": 4, "vllm:kvblend_load_errors": 0,
                   "vllm:kvblend_stores": 0}


def test_vllm_serves_when_kvblend_is_down_at_start(model: Path, alone: dict) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    llm = engine(model, url, "blend")
    try:
        for name, (prompt, _, _) in SHAPES.items():
            tokens_, params = generate(llm, prompt, 8)
            assert params["loaded_tokens"] == 0 and tokens_ == alone[name][0], name
    finally:
        close(llm)


def test_chunks_evicted_before_the_load_are_computed_as_gaps(
        model: Path, service: Service, stored: None, alone: dict) -> None:
    prompt, claim, _ = SHAPES["a stored 300-token system prompt"]
    llm = engine(model, service.url, "blend", evict=True)  # clears kvblend before each load
    try:
        tokens_, params = generate(llm, prompt, 8)
    finally:
        close(llm)
    assert params["loaded_tokens"] == claim
    (_, _, _, done), = probe.SEEN["blends"]
    assert done.first == {0, 1, 2} and not done.late
    assert probe.SEEN["errors"] == set()
    assert tokens_ == alone["a stored 300-token system prompt"][0]


def test_preempted_requests_stores_complete_and_hold_their_own_kv(
        tmp_path: Path, service: Service) -> None:
    """Eight requests in a cache of 40 blocks: vLLM preempts running requests whose prompt store
    was issued; each store is complete once ``handle_preemptions`` returned (before vLLM reuses
    the blocks), and holds the prompt's own KV (another engine loading it generates the same).
    NOTE: on the CPU data plane these small stores are done within microseconds, before any
    preemption: this test cannot see the wait itself, only its outcome. The cache is 40 MB: one
    smaller than glibc's largest mmap threshold (32 MB) can sit on the heap, which kvblend does
    not share (docs/vllm.md)."""
    model = save_model(tmp_path / "wide", hidden=512, kv_heads=4)  # 1 MB per block of 128
    prompts = [tokens(300, 40 + i) for i in range(8)]
    small = {"kv_cache_memory_bytes": 40 << 20, "max_model_len": 1024}
    plain = engine(model, llm=small)
    try:
        want = [t for t, _, _ in generate_all(plain, prompts, 500)]
    finally:
        close(plain)
    llm = engine(model, service.url, "prefix", llm=small)
    try:
        got = generate_all(llm, prompts, 500)
    finally:
        close(llm)
    assert any(stored for _, stored, _ in probe.SEEN["preempted"]), probe.SEEN["preempted"]
    assert all(done for _, _, done in probe.SEEN["preempted"])
    assert [t for t, _, _ in got] == want
    with BlendClient(service.url) as client:
        assert all(len(client.lookup(p, str(model)).matches) == 1 for p in prompts)
    probe.SEEN["loads"] = []
    again = engine(model, service.url, "prefix", llm=small)
    try:
        assert [t for t, _, _ in generate_all(again, prompts, 500)] == want
    finally:
        close(again)
    assert len(probe.SEEN["loads"]) >= len(prompts)  # every prompt loaded its stored chunk
