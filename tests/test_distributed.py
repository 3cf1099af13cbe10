"""Multi-rank launch: results come back in rank order, failures are clean errors; gloo on the
CPU, and on CUDA an NCCL group joined after the rank's GPU is made current (checked here with
``torch.cuda`` and ``init_process_group`` mocked: no GPU needed)."""
import datetime
import os
import pickle
import queue

import pytest
import torch
import torch.distributed as dist

from tidal.runtime import distributed
from tidal.runtime.distributed import (RankError, collective_device, init_process_group_from_env,
                                       init_rank_group, rank_and_size, spawn)


def _all_reduce(rank, size, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    assert torch.get_num_threads() == 1
    return t.item(), rank_and_size(), dist.get_backend(), str(collective_device())


def _broadcast_state(rank, size):
    """Rank 0's parameters and BatchNorm buffers on every rank, and how many broadcasts gave
    them (one per dtype: float32 and num_batches_tracked's int64)."""
    from tidal.runtime.programs.replica_sync import broadcast_state

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(4, 2))  # each rank its own statistics (and num_batches_tracked 1)
    model[1].num_batches_tracked += rank
    calls, real = [], dist.broadcast

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)
    dist.broadcast = counted
    try:
        broadcast_state(model, params=True)
    finally:
        dist.broadcast = real
    return {k: v.tolist() for k, v in model.state_dict().items()}, calls


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


def _all_reduce_and_broadcast(rank, size, scale):
    return _all_reduce(rank, size, scale), _broadcast_state(rank, size)


@pytest.fixture(scope="module")
def four_ranks():
    """One 4-rank job: :func:`_all_reduce` and :func:`_broadcast_state` on each rank."""
    return spawn(_all_reduce_and_broadcast, 4, 2.0)


def test_spawn_all_reduce_two_and_four_ranks(four_ranks):
    assert spawn(_all_reduce, 2, 1.0) == [(3.0, (0, 2), "gloo", "cpu"),
                                          (3.0, (1, 2), "gloo", "cpu")]
    assert [r[0][0] for r in four_ranks] == [20.0] * 4


def test_rank_0s_state_reaches_every_rank_in_one_broadcast_per_dtype(four_ranks):
    ranks = [r[1] for r in four_ranks]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(4, 2))
    want = {k: v.tolist() for k, v in model.state_dict().items()}
    for state, calls in ranks:
        assert state == want
        assert calls == [torch.float32, torch.int64]  # not one round trip per tensor


def test_rank_exception_is_reported_not_hung():
    with pytest.raises(RankError, match="rank 1 failed: ValueError: bad shard on purpose"):
        spawn(_fails_on_rank_1, 2, pg_timeout_s=10, timeout_s=60)


def test_dead_rank_is_reported_not_hung():
    with pytest.raises(RankError) as info:
        spawn(_dies_on_rank_0, 2, pg_timeout_s=10, timeout_s=60)
    assert info.value.rank in (0, 1)


# --- which backend and device a rank joins with (torch.cuda and the group mocked) -------------

@pytest.fixture
def joins(monkeypatch):
    """The calls a rank makes to join a group, in order: ``("set_device", device)`` and
    ``("init", backend, keywords)``; two GPUs visible."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: None)
    return calls


def test_a_cuda_rank_sets_its_gpu_then_joins_nccl_bound_to_it(joins):
    assert init_rank_group("cuda", 1, 2, timeout_s=7) == torch.device("cuda", 1)
    gpu = torch.device("cuda", 1)
    assert joins == [("set_device", gpu),
                     ("init", "nccl", {"rank": 1, "world_size": 2, "device_id": gpu,
                                       "timeout": datetime.timedelta(seconds=7)})]


def test_a_cpu_rank_joins_gloo_and_touches_no_gpu(joins):
    assert init_rank_group(None, 0, 2, timeout_s=5) == torch.device("cpu")
    assert joins == [("init", "gloo", {"rank": 0, "world_size": 2,
                                       "timeout": datetime.timedelta(seconds=5)})]


def test_a_missing_gpu_is_named(joins):
    with pytest.raises(RankError, match=r"rank 3: device cuda:3 does not exist \(2 CUDA"):
        init_rank_group("cuda", 3, 4)
    assert joins == []


def test_torchrun_ranks_use_their_local_rank_gpu(joins, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    assert init_process_group_from_env("cuda", timeout_s=9)
    gpu = torch.device("cuda", 1)
    assert joins[0] == ("set_device", gpu)
    assert joins[1][1] == "nccl" and joins[1][2]["device_id"] == gpu
    assert (joins[1][2]["rank"], joins[1][2]["world_size"]) == (3, 4)


def _times_ten(rank, size):
    return rank * 10


def test_a_spawned_cuda_rank_joins_nccl_on_its_gpu(joins, monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(k, "")  # the worker sets them; restored after the test
    results = queue.Queue()
    distributed._worker(1, 2, 12345, 5.0, _times_ten, (), results, torch.device("cuda"))
    assert results.get_nowait() == (1, "ok", pickle.dumps(10))
    assert joins[0] == ("set_device", torch.device("cuda", 1))
    assert joins[1][1] == "nccl"


def test_spawn_refuses_more_cuda_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank, 1 visible"):
        spawn(_times_ten, 2, device="cuda")
    with pytest.raises(ValueError, match="give device='cuda'"):
        spawn(_times_ten, 2, device="cuda:0")
