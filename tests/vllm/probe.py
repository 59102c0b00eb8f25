"""The connector as vLLM loads it, with what the tests look at kept aside (nothing replaced):
the worker's caches, each load's blocks, each blend's claim, gaps and rows, the preempted
requests' stores, the load errors reported; and a fault on request, the service's chunks cleared
between the scheduler's lookup and the worker's load."""

from __future__ import annotations

from typing import Any

import httpx
import torch

from kvblend.engine.vllm_connector import KVBlendConnector, KVBlendMetadata

SEEN: dict[str, Any] = {"caches": None, "loads": [], "errors": set(), "blends": [],
                        "preempted": []}


class ProbedConnector(KVBlendConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        SEEN["caches"] = [kv_caches[n] for n in sorted(self._layers, key=self._layers.get)]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBlendMetadata)
        if meta.loads and self._kv_transfer_config.kv_connector_extra_config.get("evict"):
            url = self._kv_transfer_config.kv_connector_extra_config["url"]
            assert httpx.delete(url + "/v1/chunks", timeout=30).status_code == 200
        SEEN["loads"].extend((ld.req_id, list(ld.block_ids), [m.cur_st for m in ld.matches])
                             for ld in meta.loads)
        super().start_load_kv(forward_context, **kwargs)

    def _blend(self, load: Any) -> Any:
        done = super()._blend(load)
        SEEN["blends"].append((load.req_id, load.claim, list(load.gaps), done))
        return done

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        super().handle_preemptions(kv_connector_metadata)
        for req_id in kv_connector_metadata.preempted:  # (request, a store of it ran, it is done)
            t = self._saving.get(req_id)
            SEEN["preempted"].append((req_id, t is not None, t is None or t.done()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        SEEN["errors"] |= errors
        return errors
