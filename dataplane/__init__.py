"""kvblend's data plane: the only process that touches engine KV buffers.

It copies KV chunks between engine workers' buffers ``[2, L, T, D]`` (CUDA IPC or POSIX shm) and
the shared-memory store, and serves engines over a local channel. This package owns that process,
its copy engines and its client; the store itself is ``shm``'s.

Contract (stable; the API process and engines rely on it):

Process::

    KVBLEND_DP_SETTINGS='<json>' python -m kvblend.dataplane

    Takes no arguments: its whole configuration is one ``dataplane.settings.DataPlaneSettings``
    as JSON in ``KVBLEND_DP_SETTINGS`` (``kvblend serve`` builds it from its own settings;
    missing or bad ones exit 2 with one line naming the field). With P its ``shm_prefix``:

    Attaches the existing store (``Store.open(P)``) and fingerprint index ``P_fp`` (with the
    chunk size and capacity it was created with), the event log ``EventLog.open(P)``, listens on
    a Unix stream socket (default ``default_address(P)`` = ``/dev/shm/P_dataplane.sock``, mode
    0600, only peers of its own uid), prints
    ``dataplane ready pid=<pid> backend=<cpu|cuda> address=<path>`` on stdout once it accepts
    calls, indexes again (or frees) the chunks a store cut before its fingerprint registration
    left (``shm.orphans``; again every minute), reclaims dead pids' reservations and pins and the
    pins whose lease ran out every ``reclaim_interval_s`` seconds, and on
    SIGTERM/SIGINT finishes every queued call and exits 0 (2 when a name it would use is not
    the service's own: docs/security.md). Registered instances are saved in
    ``/dev/shm/P_dataplane.json``: a restarted data plane re-opens them under the same ids and
    tokens, each with a fresh lease. Counter ``dataplane_starts`` in the event log counts its
    starts.

Messages (``dataplane.messages``, msgspec tagged union, tag field ``type``)::

    request                                   reply
    Ping(request_id)                          Pong(pid, backend, version, chunk_size, shm_prefix)
    RegisterInstance(registration,            Registered(instance_id, token, lease_s)
      request_id)  (a ``dataplane.registration.Registration``, which is also the body of
                   ``POST /v1/instances``)
    RenewLease(instance_id, token, request_id)    LeaseRenewed(instance_id, lease_s)
    UnregisterInstance(instance_id, token, request_id)   Unregistered(instance_id)
    ListInstances(request_id)                 InstanceList(instances=[InstanceInfo(instance_id,
                                                model_name, world_size, worker_id, num_layers,
                                                num_tokens, hidden_dim, dtype, buffer_kind)])
    StoreChunks(instance_id, token_ids, offset, kind=StoreKind.PRE_COMPUTED|FINAL, cache_salt,
                event, done_event, token, request_id)  TransferDone(instance_id, num_chunks,
    RetrieveChunks(instance_id, token_ids, matches,      copied, failed, nbytes, duration_s)
                   offset, cache_salt, event, done_event, token, request_id)
    any request may be answered               ErrorReply(kind: ErrorKind, message)

    token_ids: little-endian uint32 bytes; matches: packed int64 rows (``MATCH_WORDS`` each:
    old_st, old_ed, cur_st, cur_ed, the chunk hash as two words), built by
    ``dataplane.client_transfer.match_bytes``; block_table: little-endian int32 block ids.

    ErrorKind -> exception (``dataplane.errors``) -> suggested HTTP status:
    unknown_instance UnknownInstance 404, forbidden Forbidden 403, too_many TooMany 429,
    bad_request BadRequest 422, out_of_range OutOfRange 422,
    layout_mismatch LayoutMismatch 409, store_full StoreFull 507, backend BackendError 500,
    internal RemoteError 500; DataPlaneUnavailable 503 and Timeout 504 are raised locally.

Channel: ``dataplane.channel.Channel(address).call(msg, timeout=None)`` returns the reply or raises
the exception of an ``ErrorReply``; thread-safe; timeout None = forever, 0 = at once, > 0 = bounded.

Client: ``dataplane.client.BlendClient`` (see there).
"""

from __future__ import annotations

from kvblend.shm.names import Names


def default_address(prefix: str) -> str:
    """The data plane's socket for store prefix ``prefix``: ``/dev/shm/{prefix}_dataplane.sock``."""
    return Names(prefix).socket


__all__ = ["default_address"]
