"""A holder host in a process of its own, for the peer-read tests and benchmark that kill it:
``python -m tests.remote.peer_holder PREFIX REDIS_URL CHUNKS SEED [LAYERS HIDDEN]``.

It opens a store under PREFIX, commits CHUNKS chunks of ``tests.remote.peer_setup``'s layout
(or LAYERS and HIDDEN; KV from SEED), starts its peer reads and writes the chunks' records
behind without values, then prints ``ready`` and waits until its stdin closes (or it is
killed)."""

from __future__ import annotations

import sys

from kvblend.dataplane.peerread import Engine, Peer
from kvblend.dataplane.remote import RemoteTier
from kvblend.dataplane.writebehind import WriteBehind
from tests.remote.conftest import KEY
from tests.remote.peer_setup import D, HOST, L, commit_chunks, document, open_store


def main(prefix: str, url: str, chunks: int, seed: int, layers: int = L, hidden: int = D
         ) -> int:
    doc = document(chunks, seed, layers, hidden)
    page = max(1 << 18, -(-(doc.ids[0].kv_bytes + 8192) // 4096) * 4096)  # one slot a page
    store = open_store(prefix, max(1 << 20, chunks * page), page)
    tier = RemoteTier(url, key=KEY)
    peer = Peer(tier, store, f"{HOST}/{prefix}", Engine(HOST), values=False)
    assert peer.publish(), "the endpoint record was not written"
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
    sys.exit(main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:])))
