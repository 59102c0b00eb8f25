"""Request and response bodies of the HTTP API: the reviewed contract behind ``openapi/openapi.json``.

Field names are the wire names. Every model carries descriptions and examples so Swagger UI shows a
runnable request for each route. The registration body is not here: it is the data plane's own
type, ``dataplane.registration.Registration``, which is also its frame (one contract).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvblend.shm.hashing import CACHE_SALT_BYTES, MAX_WORLD_SIZE, MODEL_NAME_BYTES
from kvblend.shm.telemetry import EventKind

TokenId = Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)]
HASH_EXAMPLE = "9f2c4e1ab0d3775e61c2a4f80e9b1d37"


class Health(BaseModel):
    status: Literal["ok"] = Field("ok", description="Always ok while the process serves.")


class Ready(BaseModel):
    status: Literal["ready"] = Field("ready", description="The data plane answered a ping.")


class StorageStatus(BaseModel):
    capacity_bytes: int = Field(description="Slab budget.", examples=[1 << 30])
    used_bytes: int = Field(description="Bytes of slots holding committed or reserved chunks.",
                            examples=[100663296])
    num_chunks: int = Field(description="Committed chunk objects (one per rank).", examples=[3])
    num_pinned: int = Field(description="Chunk objects pinned by a running retrieve.", examples=[0])
    evictions: int = Field(description="Chunks evicted since the store was created.", examples=[0])


class FingerprintStatus(BaseModel):
    num_entries: int = Field(description="Registered chunk fingerprints.", examples=[3])
    capacity: int = Field(description="Entries the index can hold.", examples=[1 << 20])


class DataPlaneStatus(BaseModel):
    pid: int | None = Field(description="Process id, null while it does not answer.",
                            examples=[4242])
    alive: bool = Field(description="It answered a ping just now.", examples=[True])
    restarts: int = Field(description="Times the supervisor restarted it.", examples=[0])
    address: str = Field(description="Where engines reach its channel.",
                         examples=["/dev/shm/kvblend_1000_3f9a0c5e7b21d846_dataplane.sock"])


class RemoteStatus(BaseModel):
    url: str = Field(description="The remote tier's URL (never with credentials).",
                     examples=["redis://10.0.0.5:6379"])
    known_chunks: int = Field(description="Chunk shards other hosts stored there that this host "
                                          "knows of (expired ones not yet reclaimed included).",
                              examples=[1200])
    capacity: int = Field(description="Shards it keeps track of at most.", examples=[262144])


class KVLayoutOut(BaseModel):
    num_layers: int = Field(examples=[32])
    num_tokens: int = Field(description="Token capacity of the buffer.", examples=[32768])
    hidden_dim: int = Field(description="kv_heads * head_dim of this shard.", examples=[1024])
    dtype: Literal["float16", "bfloat16", "float32"] = Field(examples=["bfloat16"])
    bytes_per_token: int = Field(description="2 * num_layers * hidden_dim * itemsize.",
                                 examples=[131072])


class Instance(BaseModel):
    instance_id: int = Field(examples=[1])
    model_name: str = Field(examples=["meta-llama/Llama-3.1-8B-Instruct"])
    world_size: int = Field(examples=[1])
    worker_id: int | None = Field(examples=[0])
    kv_layout: KVLayoutOut


class InstanceList(BaseModel):
    instances: list[Instance]


class Status(BaseModel):
    version: str = Field(examples=["0.1.0"])
    chunk_size: int = Field(examples=[256])
    backend: Literal["cpu", "cuda"] = Field(examples=["cpu"])
    shm_prefix: str = Field(examples=["kvblend_1000_3f9a0c5e7b21d846"])
    storage: StorageStatus
    fingerprints: FingerprintStatus
    instances: list[Instance]
    dataplane: DataPlaneStatus
    remote: RemoteStatus | None = Field(
        None, description="The remote tier shared with other hosts (--remote); null without one.")


class InstanceCreated(BaseModel):
    instance_id: int = Field(examples=[1])
    instance_token: str = Field(
        description="The instance's capability: unregistering (header `X-Instance-Token`), "
                    "store, retrieve and lease renewal on the data-plane channel need it. "
                    "Keep it secret; it is never shown again.",
        examples=["9b1c0f4e2d7a48e3b5a6c1d2e3f40516"])
    lease_s: float = Field(description="The instance is dropped when its owner renews nothing "
                                       "for this long.", examples=[30.0])


class LookupRequest(BaseModel):
    """A prompt's token ids and the namespace to search."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "model_name": "meta-llama/Llama-3.1-8B-Instruct", "world_size": 1,
        "token_ids": [128000, 791, 6864, 315, 9822, 374, 12366], "cache_salt": ""}]})

    model_name: str = Field(min_length=1, max_length=MODEL_NAME_BYTES)
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    token_ids: list[TokenId] = Field(description="The prompt, each id in [0, 2^32).")
    cache_salt: str = Field("", max_length=CACHE_SALT_BYTES,
                            description="Tenant salt; different salts share nothing.")
    standalone_only: bool = Field(False, description=(
        "Find only chunks whose KV was computed standalone (store_pre_computed); by default "
        "chunks stored inside a longer prompt (store_final) count too."))


class MatchOut(BaseModel):
    old_st: int = Field(description="The model's position of the chunk's first token when its "
                                    "KV was computed (the store's first_position plus the "
                                    "chunk's place).", examples=[1])
    old_ed: int = Field(examples=[257])
    cur_st: int = Field(description="Start of the chunk in this prompt.", examples=[37])
    cur_ed: int = Field(examples=[293])
    chunk_hash: str = Field(description="The chunk's store key, hex.", examples=[HASH_EXAMPLE])
    origin: Literal["pre_computed", "final", "unknown"] = Field(description=(
        "How the chunk's KV was computed: standalone (pre_computed), inside a longer prompt with "
        "attention to earlier context baked in (final), or not recorded (unknown: old_st is then "
        "the chunk's place in its stored sequence)."), examples=["pre_computed"])
    location: Literal["local", "remote"] = Field(description=(
        "Where the chunk is: in this host's store (local), or only in the remote tier (remote: "
        "another host stored it; a retrieve fetches it first, and the client's prefetch starts "
        "that early)."), examples=["local"])


class LookupResponse(BaseModel):
    matches: list[MatchOut] = Field(description="Non-overlapping, ascending by cur_st.")
    hit_tokens: int = Field(description="Distinct prompt tokens covered by matches.",
                            examples=[256])
    requested_tokens: int = Field(description="floor(len(token_ids) / chunk_size) * chunk_size.",
                                  examples=[512])


class ChunksCleared(BaseModel):
    chunks_removed: int = Field(description="Committed, unpinned chunk objects evicted.",
                                examples=[12])
    fingerprints_removed: int = Field(description="Fingerprint entries dropped.", examples=[12])


class Event(BaseModel):
    """One request event; besides the fields below it carries the event's own counts."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{
        "seq": 17, "time": 1733140000.125, "kind": "lookup_end", "request_id": "r-42",
        "requested_tokens": 512, "hit_tokens": 256, "num_chunks": 1, "duration_ms": 0.41}]})

    seq: int = Field(description="Position in the ring, increasing.")
    time: float = Field(0.0, description="Unix time in seconds.")
    kind: EventKind = Field(description="What happened; the other fields depend on it "
                                        "(``shm.telemetry``).")
    request_id: str | None = Field(None, description="The request id of the call, if any.")


class EventList(BaseModel):
    events: list[Event] = Field(description="Most recent events, newest last.")
