"""The cover: which of the verified matches a lookup returns.

This module owns one choice (step 4 of ``shm.matcher``'s lookup): a non-overlapping set of
length-``k`` matches that covers the most tokens, and among those keeps the most adjacent pairs that
continue one registered sequence (same ``seq``, ``old_st`` + k), so a document stored whole comes
back as one run. It knows nothing of the index or the store.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numpy as np
from numba import njit


@njit(cache=True)
def best_cover(cur_st, seq, old_st, k):
    """Indices of a non-overlapping cover, ascending by position.

    Candidates are length-``k`` intervals sorted by ``cur_st``. Maximizes the number chosen (covered
    tokens), then the number of adjacent pairs continuing one registered sequence; ties go to the
    earlier candidate.
    """
    n = cur_st.shape[0]
    cnt = np.zeros(n + 1, np.int64)
    adj = np.zeros(n + 1, np.int64)
    nxt = np.full(n + 1, -1, np.int64)
    suf = np.full(n + 1, n, np.int64)  # best start among candidates >= i; n is the empty cover
    for i in range(n - 1, -1, -1):
        lo, hi = i + 1, n
        while lo < hi:  # first candidate starting at or after this one ends
            mid = (lo + hi) // 2
            if cur_st[mid] < cur_st[i] + k:
                lo = mid + 1
            else:
                hi = mid
        b = suf[lo]
        cnt[i], adj[i], nxt[i] = 1 + cnt[b], adj[b], (b if b < n else -1)
        c = lo
        while c < n and cur_st[c] == cur_st[i] + k:
            if seq[c] == seq[i] and old_st[c] == old_st[i] + k:
                if cnt[c] + 1 > cnt[i] or (cnt[c] + 1 == cnt[i] and adj[c] + 1 > adj[i]):
                    cnt[i], adj[i], nxt[i] = cnt[c] + 1, adj[c] + 1, c
            c += 1
        s = suf[i + 1]
        better = cnt[i] > cnt[s] or (cnt[i] == cnt[s] and adj[i] >= adj[s])
        suf[i] = i if better else s
    out = []
    i = suf[0]
    while 0 <= i < n:
        out.append(i)
        i = nxt[i]
    return np.array(out, np.int64)


__all__ = ["best_cover"]
