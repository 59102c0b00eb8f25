"""The churn soak: one ``kvblend serve`` with a small store and a small fingerprint index, driven as
engines drive it, disturbed in between, and checked at checkpoints for what must always hold.

This module owns the driver (``Churn``) and the checkpoint. ``tests/test_soak.py`` runs it bounded,
in CI; ``python -m benchmarks.soak`` runs it for an hour and samples memory (docs/soak.md).

The driver is one engine process with one ``BlendClient``. Everything is drawn from one seed:

- a document is ``(id, model)``; its token ids and its KV bytes are drawn from ``(seed, id)``, so
  any document can be stored again and any chunk of it compared byte for byte;
- a step stores one new document of a current model and, sometimes, re-stores an earlier document
  of any model (its instance is registered again when it was retired);
- between steps, each at seeded intervals (in documents): a new model (layouts alternate, so pages
  move between layout classes; only the last few models keep an instance), ``DELETE /v1/chunks``,
  a SIGKILL of the data plane (between calls, or with a store in flight), and a restart of the
  whole service (SIGTERM, then ``kvblend serve`` again on the same prefix and port).

What the driver does when the service goes away is what an engine does: a call that failed with
``DataPlaneUnavailable`` is sent again once the service answers; instances and their tokens outlive
a data-plane restart and a service restart, so nothing is registered again.

Every store is checked as it returns: no chunk failed (the one legitimate cause, every slot pinned,
cannot happen here: nothing retrieves while the driver stores), and chunks are reported
``not_indexed`` only when the index is full. The checkpoint attaches the store and the fingerprint
index from this process and checks, in this order:

1. no reservation and no pin is left (a dead data plane's are reclaimed by the next one);
2. fingerprint entries <= committed chunks (read before any lookup: a lookup drops the stale
   entries it meets, and would hide a leak); no page of a class is empty (emptied pages go back to
   the free pool);
3. every committed chunk is a chunk of a document the driver stored since the last clear;
4. for every document with a chunk held: a lookup of the document finds each held chunk that its
   last store indexed, at its own position, and nothing the store does not hold; retrieving the
   matches copies each chunk byte for byte and writes nothing else;
5. for a sample of documents with nothing held: a lookup finds nothing.
"""

from __future__ import annotations

import os
import random
import signal
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvblend.dataplane.client import BlendClient, Transfer, TransferResult
from kvblend.dataplane.errors import DataPlaneUnavailable
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.store import ChunkKey, Store, StoreStats
from tests.harness import START_DEADLINE, PollTimeout, Service, poll

CHUNK = 256
CALL_TIMEOUT = 120.0
T = TypeVar("T")


class SoakFailure(AssertionError):
    """A checkpoint or a store found something that must never happen."""


@dataclass(frozen=True)
class Sizes:
    """The service's geometry and the documents' shapes.

    Attributes:
        storage_mb: ``--storage-mb`` (pages of ``page_mb``; ``min_slot_kb`` bounds slots a page).
        fingerprint_capacity: ``--fingerprint-capacity``: below the chunks the store holds
            (120 of the large layout, 472 of the small one), so the index fills with live
            entries and stores report chunks not indexed.
        num_layers: layers of every model's buffer.
        hidden_dims: model k's hidden size is ``hidden_dims[k % len]``: 16 KiB and 64 KiB chunks.
        max_chunks: full chunks of a document, at most (1 at least, plus a partial tail or not).
    """

    storage_mb: int = 8
    page_mb: int = 1
    min_slot_kb: int = 4
    fingerprint_capacity: int = 128
    num_layers: int = 2
    hidden_dims: tuple[int, ...] = (8, 32)
    max_chunks: int = 6

    def argv(self) -> list[str]:
        return ["--storage-mb", str(self.storage_mb), "--page-mb", str(self.page_mb),
                "--min-slot-kb", str(self.min_slot_kb),
                "--fingerprint-capacity", str(self.fingerprint_capacity)]

    @property
    def retrieve_at(self) -> int:
        """Where a checkpoint retrieves into; documents are stored from 0."""
        return (self.max_chunks + 1) * CHUNK

    @property
    def buffer_tokens(self) -> int:
        return 2 * self.retrieve_at

    def hidden_dim(self, model: int) -> int:
        return self.hidden_dims[model % len(self.hidden_dims)]

    def chunk_bytes(self, model: int) -> int:
        return 2 * self.num_layers * CHUNK * self.hidden_dim(model) * 2  # float16


@dataclass(frozen=True)
class Schedule:
    """How often each event comes: a mean in documents stored, each interval drawn uniformly from
    [mean / 2, 3 * mean / 2].

    Attributes:
        new_model: a new model becomes current (the two newest are current).
        clear: ``DELETE /v1/chunks``.
        kill: SIGKILL of the data plane; every second one with a store in flight.
        restart: SIGTERM of ``kvblend serve`` and a new one on the same prefix and port.
        checkpoint: a checkpoint (also after every clear, kill and restart).
        restore: chance that a step also re-stores an earlier document.
        live_models: instances the engine keeps registered (least recently used go first).
        absent_sample: documents with nothing held that a checkpoint looks up.
    """

    new_model: int = 12
    clear: int = 150
    kill: int = 40
    restart: int = 120
    checkpoint: int = 12
    restore: float = 0.2
    live_models: int = 3
    absent_sample: int = 16


@dataclass
class Counts:
    """What a run did. ``interrupted``: stores a kill cut short (the others completed before
    it); ``checked_chunks``: held chunks summed over checkpoints; ``most_held``: the most at one;
    ``evictions``: the store's own counter, over the run."""

    documents: int = 0
    chunks: int = 0
    kv_bytes: int = 0
    restores: int = 0
    models: int = 0
    clears: int = 0
    kills: int = 0
    kills_in_flight: int = 0
    interrupted: int = 0
    restarts: int = 0
    retries: int = 0
    not_indexed: int = 0
    checkpoints: int = 0
    checked_chunks: int = 0
    most_held: int = 0
    evictions: int = 0

    def line(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


# -- documents ----------------------------------------------------------------------------------


def doc_tokens(seed: int, doc: int, max_chunks: int) -> np.ndarray:
    """Token ids of document ``doc``: 1 to ``max_chunks`` full chunks, half of them with a tail."""
    rng = np.random.default_rng((seed, doc, 1))
    n = int(rng.integers(1, max_chunks + 1)) * CHUNK
    n += int(rng.integers(1, CHUNK)) if rng.random() < 0.5 else 0
    return rng.integers(0, 1 << 31, n, dtype=np.uint32)


def doc_kv(seed: int, doc: int, num_layers: int, num_tokens: int, hidden_dim: int) -> torch.Tensor:
    """The document's KV as the bits of ``[2, L, num_tokens, D]`` float16: any bit pattern, so a
    copy that converts, rounds or shifts anything shows."""
    rng = np.random.default_rng((seed, doc, 2))
    bits = rng.integers(-(1 << 15), 1 << 15, (2, num_layers, num_tokens, hidden_dim), np.int16)
    return torch.from_numpy(bits)


def model_name(model: int) -> str:
    return f"soak-model-{model}"


def _check_pages(st: StoreStats) -> list[str]:
    """With nothing reserved, every page of a class holds a committed chunk: an emptied page went
    back to the free pool."""
    problems = [f"class {c.chunk_class.model_name}: {c.pages} pages for {c.objects} chunks"
                for c in st.classes if c.pages > c.objects]
    if sum(c.pages for c in st.classes) + st.free_pages != st.num_pages:
        problems.append(f"pages of classes and free pages do not add up to {st.num_pages}: {st}")
    return problems


# -- the service --------------------------------------------------------------------------------


class ChurnService(Service):
    """One ``kvblend serve --backend cpu`` on ``prefix`` (and ``port``, to start again where one
    stopped) sized by ``sizes``; its stderr goes to ``log`` (appended: a restarted service writes
    on)."""

    def __init__(self, prefix: str, log: Path, sizes: Sizes, port: int | None = None) -> None:
        super().__init__(prefix, "--backend", "cpu", *sizes.argv(), "--log-level", "info",
                         port=port, defaults=(), log=log, http_timeout_s=30.0)

    def status(self) -> dict[str, Any]:
        r = self.http.get("/v1/status")
        if r.status_code != 200:
            raise SoakFailure(f"GET /v1/status: {r.status_code} {r.text}")
        return dict(r.json())

    def live_dataplane_pid(self) -> int:
        """The live data plane's pid, once there is one."""
        return poll(self.dataplane_pid, START_DEADLINE, "its pid")

    def errors(self) -> list[str]:
        """ERROR lines and tracebacks the service logged."""
        assert self.log is not None, "started with a log"
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if " ERROR " in line or line.startswith("Traceback")]


# -- the engine ---------------------------------------------------------------------------------


class Engine:
    """An engine worker: one ``BlendClient``, one instance (and CPU buffer) per model it serves;
    past ``live`` models the least recently used instance is unregistered."""

    def __init__(self, url: str, sizes: Sizes, live: int) -> None:
        self.client = BlendClient(url, timeout=CALL_TIMEOUT)
        self.sizes, self.live = sizes, live
        self._instances: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()

    def instance(self, model: int) -> tuple[int, torch.Tensor]:
        """(instance id, its buffer) of ``model``, registered when missing."""
        if model in self._instances:
            self._instances.move_to_end(model)
            return self._instances[model]
        while len(self._instances) >= self.live:
            _, (old, _) = self._instances.popitem(last=False)
            self.client.unregister(old)
        s = self.sizes
        kv = self.client.cpu_kv_buffer(s.num_layers, s.buffer_tokens, s.hidden_dim(model),
                                       torch.float16)
        inst = self.client.register_kv_cache(kv, model_name=model_name(model))
        self._instances[model] = (inst, kv)
        return inst, kv

    def close(self) -> None:
        self.client.close()


# -- the driver ---------------------------------------------------------------------------------


@dataclass
class Documents:
    """What the driver stored: each document's model, and the chunks its last store reported
    ``not_indexed``; ``since_clear``: documents stored since the last clear (only those can have
    chunks in the store)."""

    model: list[int] = field(default_factory=list)
    not_indexed: dict[int, frozenset[int]] = field(default_factory=dict)
    since_clear: set[int] = field(default_factory=set)


class Churn:
    """The soak: start with ``start()`` (or ``with``), call ``step()`` and ``checkpoint()``.

    Args:
        prefix: the shm prefix (the caller removes its names afterwards).
        log: the service's stderr.
        seed: every random choice of the run.
        sizes: service geometry and documents.
        schedule: event intervals.
    """

    def __init__(self, prefix: str, log: Path, seed: int, sizes: Sizes = Sizes(),
                 schedule: Schedule = Schedule()) -> None:
        self.prefix, self.log, self.seed = prefix, log, seed
        self.sizes, self.schedule = sizes, schedule
        self.rng = random.Random(seed)
        self._sample = random.Random(seed + 1)  # the checkpoints' own: the schedule ignores them
        self.counts = Counts()
        self.docs = Documents()
        self.service: ChurnService | None = None
        self.engine: Engine | None = None
        self._store: Store | None = None
        self._fps: FingerprintIndex | None = None
        self._evictions0 = 0
        self._current = [0]  # models new documents go to
        self._due = {name: 0 for name in ("new_model", "clear", "kill", "restart", "checkpoint")}
        for name in self._due:
            self._schedule_next(name)

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.service = ChurnService(self.prefix, self.log, self.sizes)
        self.engine = Engine(self.service.url, self.sizes, self.schedule.live_models)
        self._attach()
        self._evictions0 = self.store.stats().evictions
        self.counts.models = 1

    def close(self) -> None:
        """Unregister, stop the service (SIGTERM must end it with 0) and detach."""
        try:
            if self.engine is not None:
                self.engine.close()
            if self.service is not None:
                rc = self.service.stop()
                if rc != 0:
                    raise SoakFailure(f"kvblend serve exited with {rc} after SIGTERM")
        finally:
            self._detach()

    def __enter__(self) -> "Churn":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
            return
        try:  # already failing: stop without masking the first error
            if self.service is not None:
                self.service.kill()
        finally:
            self._detach()

    def _attach(self) -> None:
        self._detach()
        self._store = Store.open(self.prefix)
        self._fps = FingerprintIndex.attach(self.prefix)

    def _detach(self) -> None:
        if self._fps is not None:
            self._fps.close()
            self._fps = None
        if self._store is not None:
            self._store.close()
            self._store = None

    @property
    def store(self) -> Store:
        assert self._store is not None, "start() the churn first"
        return self._store

    @property
    def fingerprints(self) -> FingerprintIndex:
        assert self._fps is not None, "start() the churn first"
        return self._fps

    def _svc(self) -> ChurnService:
        assert self.service is not None, "start() the churn first"
        return self.service

    def _eng(self) -> Engine:
        assert self.engine is not None, "start() the churn first"
        return self.engine

    def targets_met(self, fold: float = 10) -> bool:
        """Distinct documents stored ``fold`` times the index's capacity in chunks and ``fold``
        times the storage in bytes."""
        s = self.sizes
        return (self.counts.chunks >= fold * s.fingerprint_capacity
                and self.counts.kv_bytes >= fold * (s.storage_mb << 20))

    # -- steps --------------------------------------------------------------------------------

    def step(self) -> None:
        """The events now due, then one new document, and sometimes a re-store."""
        for name in ("restart", "kill", "clear", "new_model", "checkpoint"):
            if self.counts.documents >= self._due[name]:
                self._schedule_next(name)
                getattr(self, f"_event_{name}")()
        doc = len(self.docs.model)
        self.docs.model.append(self.rng.choice(self._current))
        self.store_document(doc)
        n = len(doc_tokens(self.seed, doc, self.sizes.max_chunks)) // CHUNK
        self.counts.documents += 1
        self.counts.chunks += n
        self.counts.kv_bytes += n * self.sizes.chunk_bytes(self.docs.model[doc])
        if doc and self.rng.random() < self.schedule.restore:
            self.store_document(self.rng.randrange(doc))
            self.counts.restores += 1

    def _schedule_next(self, name: str) -> None:
        mean = getattr(self.schedule, name)
        self._due[name] = self.counts.documents + self.rng.randint(max(1, mean // 2),
                                                                   max(1, 3 * mean // 2))

    def _event_new_model(self) -> None:
        self._current = [self._current[-1], self.counts.models]
        self.counts.models += 1

    def _event_checkpoint(self) -> None:
        self.checkpoint()

    def _event_clear(self) -> None:
        r = self._svc().http.delete("/v1/chunks")
        if r.status_code != 200:
            raise SoakFailure(f"DELETE /v1/chunks: {r.status_code} {r.text}")
        self.docs.since_clear.clear()
        self.docs.not_indexed.clear()
        self.counts.clears += 1
        left = (self.store.stats().num_objects, len(self.fingerprints))
        if left != (0, 0):
            raise SoakFailure(f"after a clear: {left[0]} chunks and {left[1]} entries left")
        self.checkpoint()

    def _event_kill(self) -> None:
        self.counts.kills += 1
        pid = self._svc().live_dataplane_pid()
        if self.counts.kills % 2 == 0 and self.docs.model:
            self._kill_in_flight(pid)
        else:
            os.kill(pid, signal.SIGKILL)
        self._svc().dataplane_after(pid)
        self.checkpoint()

    def _kill_in_flight(self, pid: int) -> None:
        """A store sent, then the data plane killed: the store ends ok or DataPlaneUnavailable;
        then the engine stores the document again once the service is back."""
        self.counts.kills_in_flight += 1
        doc = self.rng.randrange(len(self.docs.model))
        inst, tokens = self._stage(doc)
        transfer = self._eng().client.store_pre_computed(inst, tokens)
        os.kill(pid, signal.SIGKILL)
        try:
            self._check_store(doc, transfer.wait(CALL_TIMEOUT))
        except DataPlaneUnavailable:
            self.counts.interrupted += 1
            self._svc().dataplane_after(pid)
            self.store_document(doc)

    def _event_restart(self) -> None:
        svc = self._svc()
        rc = svc.stop()
        if rc != 0:
            raise SoakFailure(f"kvblend serve exited with {rc} after SIGTERM")
        self.service = ChurnService(self.prefix, self.log, self.sizes, port=svc.port)
        self._attach()
        self.counts.restarts += 1
        self.checkpoint()

    # -- stores -------------------------------------------------------------------------------

    def _stage(self, doc: int) -> tuple[int, np.ndarray]:
        """Write the document's KV at the start of its model's buffer; (instance, tokens)."""
        model = self.docs.model[doc]
        inst, kv = self._eng().instance(model)
        tokens = doc_tokens(self.seed, doc, self.sizes.max_chunks)
        full = len(tokens) // CHUNK * CHUNK
        kv.view(torch.int16)[:, :, :full] = doc_kv(self.seed, doc, self.sizes.num_layers, full,
                                                   self.sizes.hidden_dim(model))
        return inst, tokens

    def store_document(self, doc: int) -> TransferResult:
        """Store ``doc`` (again), sent again after the service comes back; checks the result."""
        def send() -> Transfer:
            inst, tokens = self._stage(doc)
            return self._eng().client.store_pre_computed(inst, tokens)
        result = self._with_retry(lambda: send().wait(CALL_TIMEOUT))
        self._check_store(doc, result)
        return result

    def _with_retry(self, call: Callable[[], T]) -> T:
        """``call()``, sent again while it fails with ``DataPlaneUnavailable`` (the data plane
        restarting), for at most ``START_DEADLINE`` seconds."""
        failures: list[DataPlaneUnavailable] = []

        def attempt() -> tuple[T] | None:
            try:
                return (call(),)  # in a tuple: truthy whatever the call returns
            except DataPlaneUnavailable as exc:
                failures.append(exc)
                return None
        try:
            (result,) = poll(attempt, START_DEADLINE, "the data plane to take the call",
                             every_s=0.05)
        except PollTimeout as exc:
            raise SoakFailure(f"the data plane stayed away: {failures[-1]}") from exc
        self.counts.retries += len(failures)
        return result

    def _check_store(self, doc: int, res: TransferResult) -> None:
        n = len(doc_tokens(self.seed, doc, self.sizes.max_chunks)) // CHUNK
        if res.num_chunks != n:
            raise SoakFailure(f"document {doc}: a store of {n} chunks covered {res.num_chunks}")
        if res.failed and not self._every_slot_pinned():
            raise SoakFailure(f"document {doc}: chunks {res.failed} failed with nothing pinned "
                              f"({self.store.stats()})")
        if res.not_indexed and len(self.fingerprints) < self.fingerprints.capacity:
            raise SoakFailure(f"document {doc}: chunks {res.not_indexed} not indexed in an index "
                              f"of {len(self.fingerprints)} / {self.fingerprints.capacity}")
        self.docs.since_clear.add(doc)
        if res.not_indexed:
            self.docs.not_indexed[doc] = frozenset(res.not_indexed)
        else:
            self.docs.not_indexed.pop(doc, None)
        self.counts.not_indexed += len(res.not_indexed)

    def _every_slot_pinned(self) -> bool:
        st = self.store.stats()
        return st.num_pinned > 0 and st.num_pinned >= st.num_objects

    # -- the checkpoint -----------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Check everything the module docstring lists; ``SoakFailure`` naming every violation."""
        problems: list[str] = []
        self._check_quiet(problems)
        st = self.store.stats()
        entries, live = len(self.fingerprints), st.num_objects
        if entries > live:
            problems.append(f"{entries} fingerprint entries for {live} committed chunks")
        problems += _check_pages(st)
        held = self._held()
        ours = sum(int(h.sum()) for h in held.values())
        if ours != live:
            problems.append(f"{live} committed chunks, {ours} of them of documents stored since "
                            "the last clear")
        for doc, h in sorted(held.items(), key=lambda item: (self.docs.model[item[0]], item[0])):
            if h.any():
                problems += self._check_document(doc, h)
        problems += self._check_absent([d for d, h in held.items() if not h.any()])
        c = self.counts
        c.checkpoints += 1
        c.checked_chunks += live
        c.most_held = max(c.most_held, live)
        c.evictions = self.store.stats().evictions - self._evictions0
        if problems:
            raise SoakFailure(self._report(problems))

    def _report(self, problems: list[str]) -> str:
        lines = problems[:40] + ([f"... {len(problems) - 40} more"] if len(problems) > 40 else [])
        errors = self._svc().errors()[-20:]
        if errors:
            lines += ["the service logged:", *errors]
        return f"checkpoint {self.counts.checkpoints} ({self.counts.line()}):\n  " + \
            "\n  ".join(lines)

    def _check_quiet(self, problems: list[str]) -> None:
        def quiet() -> bool:
            st = self.store.stats()
            return st.num_reserved == 0 and st.num_pinned == 0
        try:
            poll(quiet, START_DEADLINE, "no reservation and no pin")
        except PollTimeout as exc:
            problems.append(f"{exc}: {self.store.stats()}")

    def _hashes(self, doc: int) -> tuple[np.ndarray, list[bytes]]:
        tokens = doc_tokens(self.seed, doc, self.sizes.max_chunks)
        return tokens, chunk_hashes(Namespace(model_name(self.docs.model[doc])), tokens, CHUNK)

    def _held(self) -> dict[int, np.ndarray]:
        """Per document stored since the last clear: which of its chunks the store holds."""
        out = {}
        for doc in self.docs.since_clear:
            ns = Namespace(model_name(self.docs.model[doc]))
            _, hashes = self._hashes(doc)
            out[doc] = self.store.contains([ChunkKey(ns.id, h) for h in hashes])
        return out

    def _check_document(self, doc: int, held: np.ndarray) -> list[str]:
        model = self.docs.model[doc]
        tokens, hashes = self._hashes(doc)
        res = self._eng().client.lookup(tokens, model_name=model_name(model))
        problems = []
        found = set()
        for m in res.matches:
            i = m.cur_st // CHUNK
            if (m.cur_st % CHUNK or m.old_st != m.cur_st or i >= len(hashes)
                    or m.chunk_hash != hashes[i] or not held[i]):
                problems.append(f"document {doc}: lookup offered {m} (held {held.tolist()})")
            found.add(i)
        skip = self.docs.not_indexed.get(doc, frozenset())
        missing = [i for i in np.flatnonzero(held).tolist() if i not in found and i not in skip]
        if missing:
            problems.append(f"document {doc} (model {model}): held chunks {missing} not found "
                            f"by a lookup (found {sorted(found)}, not indexed {sorted(skip)})")
        if not problems and res.matches:
            problems += self._check_retrieve(doc, tokens, res.matches)
        return problems

    def _check_retrieve(self, doc: int, tokens: np.ndarray, matches: list[Any]) -> list[str]:
        model = self.docs.model[doc]
        inst, kv = self._eng().instance(model)
        at, full = self.sizes.retrieve_at, len(tokens) // CHUNK * CHUNK
        region = kv.view(torch.int16)[:, :, at:at + full]
        region.fill_(-1)
        res = self._with_retry(lambda: self._eng().client.retrieve(
            inst, tokens, matches, offset=at).wait(CALL_TIMEOUT))
        if not res.ok or res.copied != len(matches):
            return [f"document {doc}: retrieve of {len(matches)} matches: {res}"]
        want = doc_kv(self.seed, doc, self.sizes.num_layers, full, self.sizes.hidden_dim(model))
        expect = torch.full_like(region, -1)
        for m in matches:
            expect[:, :, m.cur_st:m.cur_ed] = want[:, :, m.cur_st:m.cur_ed]
        if torch.equal(region, expect):
            return []
        bad = [m.cur_st // CHUNK for m in matches if not torch.equal(
            region[:, :, m.cur_st:m.cur_ed], expect[:, :, m.cur_st:m.cur_ed])]
        return [f"document {doc}: retrieved bytes differ in chunks {bad} (none: outside them)"]

    def _check_absent(self, empty: list[int]) -> list[str]:
        """A sample of the documents with nothing held, and of those stored before the last
        clear: a lookup finds nothing."""
        k, n = self.schedule.absent_sample, len(self.docs.model)
        picks = self._sample.sample(sorted(empty), min(len(empty), k))
        picks += [d for d in self._sample.sample(range(n), min(n, k))
                  if d not in self.docs.since_clear]
        problems = []
        for doc in picks:
            tokens, _ = self._hashes(doc)
            res = self._eng().client.lookup(tokens, model_name=model_name(self.docs.model[doc]))
            if res.matches:
                problems.append(f"document {doc} holds no chunk, a lookup found {res.matches}")
        return problems


__all__ = ["CHUNK", "Churn", "ChurnService", "Counts", "Schedule", "Sizes", "SoakFailure"]
