"""Multi-rank launch: results come back in rank order, failures are clean errors."""
import os

import pytest
import torch
import torch.distributed as dist

from tidal.runtime.distributed import RankError, rank_and_size, spawn


def _all_reduce(rank, size, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    assert torch.get_num_threads() == 1
    return t.item(), rank_and_size()


def _fails_on_rank_1(rank, size):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()
    return rank


def _dies_on_rank_0(rank, size):
    if rank == 0:
        os._exit(3)
    dist.barrier()
    return rank


def test_spawn_all_reduce_two_and_four_ranks():
    assert spawn(_all_reduce, 2, 1.0) == [(3.0, (0, 2)), (3.0, (1, 2))]
    assert [r[0] for r in spawn(_all_reduce, 4, 2.0)] == [20.0] * 4


def test_rank_exception_is_reported_not_hung():
    with pytest.raises(RankError, match="rank 1 failed: ValueError: bad shard on purpose"):
        spawn(_fails_on_rank_1, 2, pg_timeout_s=10, timeout_s=60)


def test_dead_rank_is_reported_not_hung():
    with pytest.raises(RankError) as info:
        spawn(_dies_on_rank_0, 2, pg_timeout_s=10, timeout_s=60)
    assert info.value.rank in (0, 1)
