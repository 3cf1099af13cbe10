"""Bagpipe's Oracle Cacher (pure): Fig. 5.5, and properties on random Zipf-like traces checked
by replaying the decisions against a model of the trainers' caches and the servers."""
import random

import pytest

from tidal.runtime.bagpipe.oracle import Lookahead, LruPlanner


def _decide(planner, trace):
    return [d for x, b in enumerate(trace) for d in planner.feed(x, b)]


def test_fig_5_5():
    """The figure's "lookahead 2" counts the current batch: L = 1 batch beyond it here."""
    ds = _decide(Lookahead(trainers=1, lookahead=1, stop=4), [[{3, 9}], [{3, 4}], [{3, 6}],
                                                              [{6, 1}]])
    assert [d.fetch[0] for d in ds] == [(3, 9), (4,), (6,), (1,)]
    assert dict(ds[0].ttl)[3] == 1            # cached, TTL = batch 2 (0-based 1)
    assert dict(ds[1].ttl)[3] == 2            # TTL update at batch 2
    assert ds[2].dropped == (3,)              # evicted after batch 3
    assert dict(ds[2].ttl)[6] == 3 and ds[3].dropped == (1, 6)
    assert [d.written_through for d in ds] == [-1, -1, 0, 1]


def test_no_window_caches_nothing():
    trace = [[{1, 2}], [{1, 3}], [{1}]]
    ds = _decide(Lookahead(trainers=1, lookahead=0, stop=3), trace)
    for d, b in zip(ds, trace):
        assert d.fetch[0] == tuple(sorted(b[0])) and d.dropped == tuple(sorted(b[0]))
        assert d.written_through == d.batch - 1 and not d.deferred


def _zipf_trace(seed, batches, trainers, rows, per_shard, alpha):
    rng = random.Random(seed)
    w = [1.0 / (r + 1) ** alpha for r in range(rows)]
    perm = list(range(rows))
    rng.shuffle(perm)
    return [[{perm[i] for i in rng.choices(range(rows), w, k=per_shard)} for _ in range(trainers)]
            for _ in range(batches)]


def _replay(ds, T, L):
    """Replay decisions on a model: servers hold a version per id, each trainer's cache holds
    (version) per id; every use must read the latest version. Write-backs of a batch land when
    its syncs are done; a prefetch reads the server after ``written_through`` is written."""
    server, caches, latest = {}, [dict() for _ in range(T)], {}
    pending_writes = {}  # batch -> list of (id, version)
    owner = {}
    for d in ds:
        x = d.batch
        for b in [b for b in pending_writes if b <= d.written_through]:
            for i, v in pending_writes.pop(b):
                server[i] = v
        for i, o in d.promote:                      # promotions happen before x
            assert owner[i] == o
            for r in range(T):
                caches[r][i] = caches[o][i]
            owner[i] = -1
        for r in range(T):
            for i in d.fetch[r]:
                assert i not in caches[r], (x, r, i)
                caches[r][i] = server.get(i, 0)
        for r in range(T):
            for i in d.uses[r]:
                assert caches[r].get(i) == latest.get(i, 0), (x, r, i)  # never stale
        used = set().union(*map(set, d.uses))
        for r in range(T):
            for i in d.local[r]:
                owner.setdefault(i, r)
                assert owner[i] == r and all(i not in d.uses[q] for q in range(T) if q != r)
        shared = used - set().union(*map(set, d.local))
        assert set(d.critical) | set(d.background) == shared
        assert not set(d.critical) & set(d.background)
        for i in used:
            latest[i] = latest.get(i, 0) + 1
            holders = [r for r in range(T) if i in caches[r]]
            if i in shared:
                assert holders == list(range(T))
                owner[i] = -1
            else:
                assert len(holders) == 1
                owner[i] = holders[0]
            for r in holders:
                caches[r][i] = latest[i]
        writes = []
        for r in range(T):
            for i in d.writeback[r]:
                writes.append((i, caches[r][i]))
        assert sorted(i for i, _ in writes) == list(d.dropped)
        for i in d.dropped:
            for r in range(T):
                caches[r].pop(i, None)
            owner.pop(i, None)
        pending_writes[x] = writes
        yield d, used


@pytest.mark.parametrize("T,L,alpha,seed", [(1, 2, 1.2, 0), (2, 0, 1.0, 1), (2, 1, 0.5, 2),
                                            (2, 3, 1.5, 3), (3, 5, 1.1, 4), (2, 8, 0.8, 5)])
def test_random_traces_consistent(T, L, alpha, seed):
    n = 40
    trace = _zipf_trace(seed, n, T, rows=60, per_shard=6, alpha=alpha)
    ds = _decide(Lookahead(trainers=T, lookahead=L, stop=n), trace)
    assert [d.batch for d in ds] == list(range(n))
    W = L + 1
    for d, used in _replay(ds, T, L):
        x = d.batch
        assert d.written_through == max(x - W, -1)
        nxt = set().union(*trace[x + 1]) if x + 1 < n else set()
        if x + 1 < n and W > 1:                  # critical: exactly those x+1 needs
            assert set(d.critical) <= nxt and not set(d.background) & nxt
            assert d.deferred
        else:
            assert not d.background
        for i in d.fetch[0] if T == 1 else ():  # fetched ids unused in the window behind
            assert all(i not in set().union(*trace[b]) for b in range(max(0, x - W + 1), x))


def test_lrpp_local_ids_one_user_during_residency():
    T, n = 2, 60
    trace = _zipf_trace(7, n, T, rows=40, per_shard=5, alpha=1.2)
    ds = _decide(Lookahead(trainers=T, lookahead=4, stop=n), trace)
    users, local_seen = {}, 0
    for d in ds:
        for r in range(T):
            for i in d.uses[r]:
                users.setdefault(i, set()).add(r)
        for r in range(T):
            for i in d.writeback[r]:
                if i in d.local[r] or (i in users and len(users[i]) == 1
                                       and i not in d.critical + d.background):
                    assert users[i] == {r}
                    local_seen += 1
        for i in d.dropped:
            users.pop(i)
    assert local_seen > 0
    assert any(d.promote for d in ds)  # the trace exercises promotions too


def test_segments_flush_and_restart():
    T, n = 2, 12
    trace = _zipf_trace(3, n, T, rows=30, per_shard=5, alpha=1.3)
    full = _decide(Lookahead(trainers=T, lookahead=3, stop=n, segment=4), trace)
    for d in full:
        if d.batch % 4 == 3:
            assert not d.background and set(d.dropped) == set().union(*map(set, d.uses))
        if d.batch % 4 == 0:
            assert d.written_through == d.batch - 1
    again = Lookahead(trainers=T, lookahead=3, stop=n, start=8, segment=4)
    tail = [d for x in range(8, n) for d in again.feed(x, trace[x])]
    assert tail == full[8:]


def test_lru_and_none_planners():
    T, n = 2, 30
    trace = _zipf_trace(9, n, T, rows=25, per_shard=5, alpha=1.2)
    for rows in (0, 8):
        ds = _decide(LruPlanner(trainers=T, rows=rows, stop=n), trace)
        for d, used in _replay(ds, T, 1):
            assert set(d.critical) == used and not d.background
            assert all(not loc for loc in d.local)
        if rows == 0:
            assert all(set(d.dropped) == set().union(*map(set, d.uses)) for d in ds)


def test_bad_arguments():
    with pytest.raises(ValueError, match="trainers"):
        Lookahead(trainers=0, lookahead=1, stop=3)
    o = Lookahead(trainers=2, lookahead=1, stop=3)
    with pytest.raises(ValueError, match="2 trainers"):
        o.feed(0, [{1}])
    with pytest.raises(ValueError, match="out of order"):
        o.feed(1, [{1}, {2}])
