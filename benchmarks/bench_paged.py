"""Paged caches through the whole call path: store, retrieve and layer-wise retrieve GB/s.

An engine's cache in the FlashAttention layout (per layer ``[2, blocks, 16, kv_heads, head_dim]``,
each layer its own allocation, as vLLM allocates them; ``--layout cpu_kt``, CPU only: vLLM's CPU
cache, ``[blocks, kv_heads, 16, 2 * head_dim]``), Llama-3.1-8B shapes by default, ``--tokens``
of documents placed by a shuffled block table. Side by side in the same run: a pinned ``copy_``
of the same bytes each way (the PCIe limit) and the plain retrieve. Layer-wise: the time until
layer 0 can be read (``wait_layer(0)``, then the stream's wait on its event completed), until
the last layer can be read (``last layer``) and until the whole call completed. ``store
ready`` / ``retr. ready``: a call timed until its copies completed (``wait_queued``, then the
stream synchronized: the engine's buffer free again, or its bytes readable), not until the
reply; the commits, unpins and reply that follow are not timed. ``x4``: four calls sent back to
back on one instance (calls in flight).
``turned``: the retrieve into a cache registered with Llama-3.1's rotary config, K turned to positions
1000 further on (``dataplane.rotary``).

Usage::

    python benchmarks/bench_paged.py                       # CUDA, 32 layers, 8k tokens
    python benchmarks/bench_paged.py --backend cpu --layers 4 --tokens 2048
    python benchmarks/bench_paged.py --backend cpu --layout cpu_kt   # vLLM's CPU cache
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_dataplane import (CHUNK, IN_FLIGHT, limits_cpu, limits_cuda, median_time,  # noqa: E402
                             start_dataplane)
from kvblend.dataplane import default_address  # noqa: E402
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.dataplane.registration import RotaryConfig  # noqa: E402
from kvblend.shm.fingerprint import FingerprintIndex  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from kvblend.shm.store import Store, StoreConfig  # noqa: E402

S = 16


def layers_of(client: BlendClient, backend: str, L: int, B: int, H: int, Dh: int,
              layout: str = "flash_attn") -> list[torch.Tensor]:
    if backend == "cpu":
        layers = client.cpu_paged_kv_cache(L, B, S, H, Dh, torch.bfloat16, layout=layout)
        for t in layers:
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16))
        return layers
    return [torch.randn((2, B, S, H, Dh), device="cuda").to(torch.bfloat16) for _ in range(L)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--storage-gib", type=float, default=6.0)
    p.add_argument("--layout", choices=("flash_attn", "cpu_kt"), default="flash_attn",
                   help="cpu_kt (vLLM's CPU cache, K transposed): the CPU backend only")
    p.add_argument("--order-events", action="store_true",
                   help="order the calls by interprocess events, not by the order word "
                        "(dataplane.streamword, the client's default)")
    args = p.parse_args()
    if args.layout == "cpu_kt" and args.backend != "cpu":
        p.error("--layout cpu_kt needs --backend cpu (the CUDA data plane refuses it)")
    L, H, Dh, N = args.layers, args.kv_heads, args.head_dim, args.tokens
    B = N // S + 64
    nbytes = 2 * L * N * H * Dh * 2
    prefix = f"kvbench_{os.getpid()}"
    Store.open(prefix, StoreConfig(capacity_bytes=int(args.storage_gib * (1 << 30)),
                                   page_bytes=256 << 20)).close()
    FingerprintIndex.open(prefix, CHUNK, capacity=1 << 16).close()
    proc = start_dataplane(prefix, args.backend)
    device = torch.cuda.get_device_name() if args.backend == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"# {device}; {L} layers x {H} heads x {Dh}, bf16, {N} tokens = "
          f"{nbytes / (1 << 20):.1f} MiB a call in {N // CHUNK} chunks, blocks of {S}; "
          f"medians of {args.iters}")
    rng = np.random.default_rng(0)
    try:
        with BlendClient(dataplane_address=default_address(prefix),
                         order_words=not args.order_events) as client:
            src, dst = (layers_of(client, args.backend, L, B, H, Dh, args.layout)
                        for _ in range(2))
            reg = [client.register_paged_kv_cache(x, args.layout, S, H, Dh, model_name="bench")
                   for x in (src, dst)]
            # the same cache registered with Llama-3.1's rotary config: its retrieves turn K
            turned = client.register_paged_kv_cache(
                layers_of(client, args.backend, L, B, H, Dh, args.layout), args.layout, S, H, Dh,
                model_name="bench", rotary=RotaryConfig(
                    head_dim=Dh, theta=500000.0, scaling="llama3", factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
            tables = [rng.permutation(B)[:N // S] for _ in range(2)]
            tokens = rng.integers(0, 2**31, N)
            assert client.store_pre_computed(reg[0], tokens, block_table=tables[0]).wait().ok
            matches = client.lookup(tokens, "bench").matches
            assert len(matches) == N // CHUNK

            drawn: list[np.ndarray] = []

            def draw(k: int = 1) -> None:  # untimed: fresh tokens for the next k stores
                drawn[:] = [rng.integers(0, 2**31, N) for _ in range(k)]

            def take() -> np.ndarray:
                return drawn.pop() if drawn else rng.integers(0, 2**31, N)

            def store() -> None:
                with client.store_pre_computed(reg[0], take(), block_table=tables[0]) as t:
                    done = t.wait()  # the with block gives the call's CUDA events back for reuse
                assert done.ok and done.copied == N // CHUNK, done

            def refill() -> None:  # untimed: the timed stores may have evicted the set
                with client.store_pre_computed(reg[0], tokens, block_table=tables[0]) as t:
                    assert t.wait().ok

            def retrieve() -> None:
                with client.retrieve(reg[1], tokens, matches, block_table=tables[1]) as t:
                    assert t.wait().ok

            def retrieve_turned() -> None:  # K turned to positions 1000 further on
                with client.retrieve(turned, tokens, matches, block_table=tables[1],
                                     first_position=1000) as t:
                    assert t.wait().ok

            def sync() -> None:
                if args.backend == "cuda":
                    torch.cuda.current_stream().synchronize()

            firsts: list[float] = []
            lasts: list[float] = []  # the layer-wise call's last layer readable

            def layerwise() -> None:
                t0 = time.perf_counter()
                with client.retrieve(reg[1], tokens, matches, block_table=tables[1],
                                     layer_groups=L) as t:
                    assert t.wait_layer(0) == []
                    sync()
                    firsts.append(time.perf_counter() - t0)
                    assert t.wait_layer(L - 1) == []
                    sync()
                    lasts.append(time.perf_counter() - t0)
                    assert t.wait().ok

            open_calls: list = []  # "ready" calls whose untimed rest has not ended

            def settle() -> None:
                while open_calls:
                    t = open_calls.pop()
                    assert t.wait().ok
                    t.release()

            def store_ready() -> None:  # until the engine may reuse its buffer
                t = client.store_pre_computed(reg[0], take(), block_table=tables[0])
                open_calls.append(t)
                assert not t.wait_queued()
                sync()

            def retrieve_ready() -> None:  # until the engine may read the bytes
                t = client.retrieve(reg[1], tokens, matches, block_table=tables[1])
                open_calls.append(t)
                assert not t.wait_queued()
                sync()

            def stores_in_flight() -> None:
                calls = [client.store_pre_computed(reg[0], take(), block_table=tables[0])
                         for _ in range(IN_FLIGHT)]
                assert all(c.wait().copied == N // CHUNK for c in calls)
                for c in calls:
                    c.release()

            def retrieves_in_flight() -> None:
                calls = [client.retrieve(reg[1], tokens, matches, block_table=tables[1])
                         for _ in range(IN_FLIGHT)]
                assert all(c.wait().ok for c in calls)
                for c in calls:
                    c.release()

            store(), refill(), retrieve(), layerwise(), retrieve_turned()  # warm
            firsts.clear(), lasts.clear()
            lim = (limits_cuda(nbytes, args.iters, L, H * Dh, N // CHUNK)
                   if args.backend == "cuda" else limits_cpu(nbytes, args.iters))
            lim_store, lim_retrieve = lim["store"], lim["retrieve"]
            got = {"store": nbytes / median_time(store, args.iters, draw),
                   "retrieve": nbytes / median_time(retrieve, args.iters, refill),
                   "layer-wise": nbytes / median_time(layerwise, args.iters, refill),
                   "turned": nbytes / median_time(retrieve_turned, args.iters, refill),
                   "store ready": nbytes / median_time(store_ready, args.iters,
                                                       lambda: (settle(), draw())),
                   "retr. ready": nbytes / median_time(retrieve_ready, args.iters,
                                                       lambda: (settle(), refill()))}
            settle()
            got["last layer"] = nbytes / statistics.median(lasts)
            limit = {"store": lim_store, "retrieve": lim_retrieve, "layer-wise": lim_retrieve,
                     "turned": lim_retrieve, "store ready": lim_store,
                     "retr. ready": lim_retrieve, "last layer": lim_retrieve}
            if IN_FLIGHT * nbytes <= args.storage_gib * (1 << 30) * 3 / 4:
                x = f"x{IN_FLIGHT}"
                got["store " + x] = IN_FLIGHT * nbytes / median_time(
                    stores_in_flight, args.iters, lambda: draw(IN_FLIGHT))
                got["retrieve " + x] = IN_FLIGHT * nbytes / median_time(retrieves_in_flight,
                                                                       args.iters, refill)
                limit["store " + x], limit["retrieve " + x] = lim_store, lim_retrieve
            print(f"{'op':<11} {'GB/s':>7} {'limit GB/s':>10} {'ratio':>6}")
            for op, v in got.items():
                print(f"{op:<11} {v / 1e9:>7.2f} {limit[op] / 1e9:>10.2f} {v / limit[op]:>6.3f}")
            print(f"layer-wise: layer 0 readable after {1e3 * statistics.median(firsts):.2f} ms "
                  f"(median); whole call at {got['layer-wise'] / got['retrieve']:.3f} of the "
                  f"plain retrieve's speed")
            print(f"turned: the retrieve turning K (Llama-3.1 rotary) takes "
                  f"{got['retrieve'] / got['turned'] - 1:+.1%} over the plain retrieve's time")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        destroy(prefix)


if __name__ == "__main__":
    main()
