"""The connector as vLLM loads it, with what the tests look at kept aside (nothing replaced):
the worker's caches, each load's blocks, the load errors reported; and a fault on request, the
service's chunks cleared between the scheduler's lookup and the worker's load."""

from __future__ import annotations

from typing import Any

import httpx
import torch

from engine.vllm_connector import KVBlendConnector, KVBlendMetadata

SEEN: dict[str, Any] = {"caches": None, "loads": [], "errors": set()}


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

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        SEEN["errors"] |= errors
        return errors
