"""A holder host in a process of its own, for the peer-read tests and benchmark that kill it:
``python -m tests.remote.peer_holder PREFIX REDIS_URL CHUNKS SEED``.

It opens a store under PREFIX, commits CHUNKS chunks of ``tests.remote.test_peer_read``'s layout
(KV from SEED), starts its peer reads and writes the chunks' records behind without values, then
prints ``ready`` and waits until its stdin closes (or it is killed)."""

from __future__ import annotations

import sys

from kvblend.dataplane.peerread import Engine, Peer
from kvblend.dataplane.remote import RemoteTier
from kvblend.dataplane.writebehind import WriteBehind
from tests.remote.conftest import KEY
from tests.remote.peer_setup import HOST, commit_chunks, document, open_store


def main(prefix: str, url: str, chunks: int, seed: int) -> int:
    store = open_store(prefix)
    tier = RemoteTier(url, key=KEY)
    peer = Peer(tier, store, f"{HOST}/{prefix}", Engine(HOST), values=False)
    assert peer.publish(), "the endpoint record was not written"
    doc = document(chunks, seed)
    class_id, keys = commit_chunks(store, doc)
    wb = WriteBehind(store, tier, peer=peer)
    wb.offer(class_id, doc.ns.root, keys, doc.rows)
    assert wb.flush(timeout=30.0) and wb.counts["written"] == chunks, wb.counts
    print("ready", flush=True)
    sys.stdin.read()
    wb.close(timeout=5.0)
    peer.close()
    tier.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
