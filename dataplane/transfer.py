"""Store and retrieve: keys, reservations, pins, copies and commits for one call of one instance.

This module owns the order of operations that keeps the store consistent whatever the backend:

- store: compute the chunk keys, reserve the call's slots in batches (``Store.reserve_slots``:
  EXISTS = already stored or being stored elsewhere, not copied again; FULL = failed), enqueue
  the copies in groups of about ``Tuning.group_bytes`` with a completion marker after each group, and
  commit each group once its marker completed, while later groups are still copying; on any
  failure wait for the copies in flight, then abort every reservation not yet committed. Rank 0
  (``worker_id`` 0 or None) then registers the chunks' fingerprints (after the last commit: the
  index only keeps entries of committed chunks).
- retrieve: pin the matched chunks in batches of at most ``PIN_BATCH`` (``Store.pin_slots``),
  check them against the prompt, copy each into ``offset + cur_st`` of the buffer, and unpin a
  batch once its copies completed; at most two batches are pinned at a time, so a retrieve of any
  length fits the pin table. A chunk evicted meanwhile, of another layout, whose tokens differ
  from the prompt's at ``cur_st``, or that found the pin table full (other retrieves hold it) is
  reported failed by match index with its reason (``ChunkFailure``); nothing is written for it.
  A store's chunk that found no room (every slot it fits pinned or being written) is reported
  failed with ``no_room``.
- layer-wise retrieve (``layer_groups``): pin every match at once (at most
  ``MAX_LAYER_GROUP_MATCHES``), then copy the layers group by group, announcing each group
  through ``progress`` once its copies completed (CPU) or its event was recorded (CUDA).
- a paged buffer maps a call's logical token positions to slots through its block table
  (``InstanceBuffer.bind``); every chunk is checked to have slots before any side effect.

Each call is a generator (``Call``) with one ``yield``, once every copy is queued: the instance's
worker runs it that far, its completion thread (``dataplane.instance``) the rest, so the next call
is prepared while these copies run. Before the ``yield`` a store or plain retrieve sends one
``LayersReady`` of every layer: the engine may reuse (store) or read (retrieve) its buffer after
the done event from then on, without waiting for the commits and the reply.

The first batch of a call is small (about ``Tuning.first_bytes``): its copies start while the next
one is reserved or pinned; each batch is twice the one before, so the copies already queued keep
the GPU busy while the next batch is reserved or pinned (measured on a 2-core VM: hashing and
reserving the other 504 chunks of a 512-chunk call at once took 5 ms or more, while the first
batch's 16 MiB take 0.3 ms to cross PCIe). No per-chunk Python object is built: a call's keys are
the store's int64 words (``shm.keys.batch_words``), made into objects only for the remote tier,
and a retrieve's matches arrive as packed rows, checked in one compiled pass
(``dataplane.calls.match_rows``). A call's start event is logged once its first copies are queued
(``dataplane.calls.StartOnce``): the log write is not on the path to them.

It does not own threads or sockets (``dataplane.server``) or how bytes move (``dataplane.backend``).
It is the door to the calls; their steps live in ``dataplane.storing`` (a store),
``dataplane.retrieving`` (a retrieve, a prefetch) and ``dataplane.calls`` (what both share).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvblend.dataplane.calls import (Call, Gate, Shared, Tuning, forget_evicted, run_to_end,
                                     tokens_of)
from kvblend.dataplane.messages import RetrieveChunks, StoreChunks, TransferDone
from kvblend.dataplane.retrieving import prefetch, retrieve_call
from kvblend.dataplane.storing import store_call

if TYPE_CHECKING:
    from kvblend.dataplane.instance import Instance


def run_store(sh: Shared, inst: "Instance", msg: StoreChunks) -> TransferDone:
    return run_to_end(store_call(sh, inst, msg))


def run_retrieve(sh: Shared, inst: "Instance", msg: RetrieveChunks) -> TransferDone:
    return run_to_end(retrieve_call(sh, inst, msg))


__all__ = ["Shared", "Tuning", "Call", "Gate", "store_call", "retrieve_call", "run_to_end",
           "run_store", "run_retrieve", "tokens_of", "prefetch", "forget_evicted"]
