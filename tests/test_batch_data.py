"""Data as users shard it (``tidal.runtime.batch_data.global_batch``, ``compile(batch=)``).

One spawned 2-rank gloo job runs every multi-rank check (each returns what it saw, the tests
below assert it): ``batch="local"`` joins the ranks' batches along dim 0 in rank order (equal
and unequal sizes, tuple and dict inputs, mixed dtypes) so the data-parallel sharding gives
each rank its own rows back; non-tensor values must agree; ``batch="global"`` passes equal
batches through and raises, on every rank and without hanging, naming the input and the ranks
when they differ (a changed element, reordered rows); a dim-0 mismatch is an error naming the
tensor on every rank even when only one rank has it; and a compiled MLP stepping on each rank's
own half with ``batch="local"`` equals DDP on the same halves (max |Δparam| <= 1e-6 after 3
SGD steps), with the compression pass and with no pass. World size 1 needs no spawn.
"""
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal
from tidal.compiler.api import check_batch_options
from tidal.runtime.batch_data import BatchError, fingerprints, global_batch
from tidal.runtime.distributed import spawn
from tidal.runtime.programs.batch_shards import shard

WORLD = 2
HANG_S = 20.0
"""A check that raises must raise well before the process group's timeout (60 s)."""


def _rows(n, start=0, width=3):
    return torch.arange(start * width, (start + n) * width, dtype=torch.float32).reshape(n, width)


def _raises(fn):
    """The ``BatchError`` message ``fn()`` raised (``None`` if it returned) and the seconds
    it took."""
    t0 = time.monotonic()
    try:
        fn()
    except BatchError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def _local_equal(rank, size):
    """Equal local batches, tuple inputs: the rank-order concatenation, and ``shard`` of it
    gives this rank its own rows back."""
    x, y = _rows(4, 4 * rank), torch.arange(4 * rank, 4 * rank + 4)
    (gx,), gy = global_batch((x,), y, "local")
    return {"x": torch.equal(gx, _rows(4 * size)), "y": torch.equal(gy, torch.arange(4 * size)),
            "shard": torch.equal(shard((gx,), rank, size, 4 * size)[0], x)
            and torch.equal(shard(gy, rank, size, 4 * size), y)}


def _local_unequal(rank, size):
    """A last, smaller batch (3 rows on rank 0, 2 on rank 1), dict inputs of several dtypes, a
    dict of targets and a Python value passed through."""
    n, start = (3, 0) if rank == 0 else (2, 3)
    ids = torch.arange(start, start + n).repeat_interleave(4).reshape(n, 4) * 7
    inputs = {"input_ids": ids, "attention_mask": ids % 2 == 0,
              "scale": torch.full((n, 2), float(start), dtype=torch.bfloat16), "causal": True}
    targets = {"labels": ids + 1, "weight": torch.arange(start, start + n, dtype=torch.float64)}
    gi, gt = global_batch(inputs, targets, "local")
    every = torch.arange(0, 5).repeat_interleave(4).reshape(5, 4) * 7
    starts = torch.tensor([0.0, 0, 0, 3, 3], dtype=torch.bfloat16)
    return {"ids": torch.equal(gi["input_ids"], every),
            "mask": torch.equal(gi["attention_mask"], every % 2 == 0),
            "scale": torch.equal(gi["scale"], starts[:, None].expand(5, 2)),
            "causal": gi["causal"] is True, "keys": list(gi) == list(inputs),
            "labels": torch.equal(gt["labels"], every + 1),
            "weight": torch.equal(gt["weight"], torch.arange(5, dtype=torch.float64))}


def _local_mismatch(rank, size):
    """A Python value, a trailing shape or the inputs' keys that differ: every rank raises,
    naming the value (the tensor, the structures) and the ranks; with ``check=False`` the value
    is not compared."""
    x = _rows(2, 2 * rank)
    value, value_s = _raises(lambda: global_batch((x, rank == 0), None, "local"))
    unchecked = global_batch((x, rank == 0), None, "local", check=False)[0][1] == (rank == 0)
    wide = _rows(2, 0, width=3 + rank)
    shape, shape_s = _raises(lambda: global_batch((wide,), None, "local"))
    keys = {"a": x, "b": x} if rank == 1 else {"a": x}
    tree, tree_s = _raises(lambda: global_batch(keys, None, "local"))
    return {"value": value, "unchecked": unchecked, "shape": shape, "tree": tree,
            "seconds": max(value_s, shape_s, tree_s)}


def _global(rank, size):
    """Equal global batches come back as they are; a changed element of one input and rows
    in another order are errors on every rank naming the input and the ranks; ``check=False``
    does not look."""
    x, mask, y = _rows(6), torch.ones(6, 2, dtype=torch.bool), torch.arange(6)
    same = global_batch((x, mask), {"y": y}, "global")
    changed = x.clone()
    changed[5, 2] += rank
    element, element_s = _raises(lambda: global_batch((mask, changed), {"y": y}, "global"))
    order = y.flip(0) if rank == 1 else y
    reordered, reordered_s = _raises(lambda: global_batch((x,), {"y": order}, "global"))
    unchecked = global_batch((changed,), y, "global", check=False)[0][0] is changed
    return {"same": same[0][0] is x and same[1]["y"] is y, "element": element,
            "reordered": reordered, "unchecked": unchecked,
            "seconds": max(element_s, reordered_s)}


def _dim0(rank, size):
    """A target whose dim 0 is not the batch's, on every rank and on rank 1 only, under both
    conventions: every rank raises, naming the target (and, when only one rank has it, that
    rank)."""
    x = _rows(4)
    both, both_s = _raises(lambda: global_batch((x,), x[:1], "global"))
    short = {"labels": torch.zeros(3 if rank == 1 else 4)}
    one, one_s = _raises(lambda: global_batch((x,), short, "local"))
    return {"both": both, "one": one, "seconds": max(both_s, one_s)}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _half(step, rank, size):
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    per = 8 // size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _versus_ddp(rank, size):
    """Max |Δparam| against DDP after 3 SGD steps on each rank's own half, with
    ``batch="local"``, under the compression pass (no compression) and with no pass."""
    out = {}
    for label, kw in (("compression", {"passes": ["compression"], "compressor": "none"}),
                      ("no pass", {})):
        ref = DDP(_mlp())
        opt = _sgd(ref.parameters())
        x0, y0 = _half(0, rank, size)
        try:
            compiled = tidal.compile(_mlp(), (x0,), example_targets=y0, batch="local",
                                     loss_fn=nn.functional.cross_entropy, optimizer=_sgd, **kw)
            for step in range(3):
                x, y = _half(step, rank, size)
                opt.zero_grad()
                nn.functional.cross_entropy(ref(x), y).backward()
                opt.step()
                compiled.step((x,), y)
            out[label] = max((p - q).abs().max().item() for p, q in
                             zip(compiled.model.parameters(), ref.module.parameters()))
        except Exception as e:  # reported to the test, which says what failed
            out[label] = f"{type(e).__name__}: {e}"
    return out


def _all(rank, size):
    """Every multi-rank check in one job, in an order that keeps the ranks in step (each
    check's collectives are the same on every rank; the end-to-end one runs last)."""
    return {check.__name__: check(rank, size)
            for check in (_local_equal, _local_unequal, _local_mismatch, _global, _dim0,
                          _versus_ddp)}


@pytest.fixture(scope="module")
def ranks():
    """The results of the one spawned job, per rank."""
    return spawn(_all, WORLD)


def test_local_batches_are_joined_in_rank_order_and_shard_back(ranks):
    for rank, seen in enumerate(ranks):
        assert seen["_local_equal"] == {"x": True, "y": True, "shard": True}, rank
        assert all(seen["_local_unequal"].values()), (rank, seen["_local_unequal"])


def test_local_batches_must_agree_apart_from_their_rows(ranks):
    for rank, seen in enumerate(ranks):
        got = seen["_local_mismatch"]
        assert got["value"] and "inputs[1] differs across ranks" in got["value"], got
        assert "ranks [0]: True" in got["value"] and "ranks [1]: False" in got["value"], got
        assert got["unchecked"], rank
        assert got["shape"] and "inputs[0] differs" in got["shape"], got
        assert "(*, (3,))" in got["shape"] and "(*, (4,))" in got["shape"], got
        assert got["tree"] and "differently structured batches" in got["tree"], got
        assert "ranks [0]:" in got["tree"] and "ranks [1]:" in got["tree"], got
        assert got["seconds"] < HANG_S, got


def test_global_batches_that_differ_are_named_on_every_rank(ranks):
    for rank, seen in enumerate(ranks):
        got = seen["_global"]
        assert got["same"] and got["unchecked"], (rank, got)
        for key, name in (("element", "inputs[1]"), ("reordered", "targets['y']")):
            assert got[key] and f"{name} differs across ranks" in got[key], (key, got)
            assert "ranks [0]:" in got[key] and "ranks [1]:" in got[key], (key, got)
            assert "compile(..., batch='local')" in got[key], (key, got)
        assert "inputs[0] differs" not in got["element"], got   # the mask agrees
        assert got["seconds"] < HANG_S, got


def test_a_tensor_not_of_the_batch_is_an_error_never_replicated(ranks):
    for rank, seen in enumerate(ranks):
        got = seen["_dim0"]
        assert got["both"] and "targets has 1 rows in dim 0 but the batch has 4" in got["both"]
        assert got["one"] and "rank 1: targets['labels'] has 3 rows" in got["one"], got
        assert "rank 0:" not in got["one"], got
        assert got["seconds"] < HANG_S, got


def test_local_batches_step_like_ddp(ranks):
    for rank, seen in enumerate(ranks):
        for label, delta in seen["_versus_ddp"].items():
            assert isinstance(delta, float) and delta <= 1e-6, (rank, label, delta)


def test_one_process_returns_the_arguments_after_the_dim0_check():
    x, y = _rows(4), {"y": torch.arange(4), "note": "keep"}
    for convention in ("global", "local"):
        inputs, targets = global_batch((x,), y, convention)
        assert inputs[0] is x and targets is y
    with pytest.raises(BatchError, match=r"targets\['y'\] has 3 rows .*dim 0 of inputs\[0\]"):
        global_batch((x,), {"y": torch.arange(3)}, "local")
    # an input with another dim 0 is a value every sample shares (position_ids of one row)
    shared = torch.ones(1, 4)
    assert global_batch({"x": x, "mask": shared}, None, "global")[0]["mask"] is shared
    with pytest.raises(ValueError, match="convention 'sharded'"):
        global_batch((x,), None, "sharded")


def test_fingerprints_tell_reordered_rows_apart():
    a = torch.randn(16, 5)
    same, flipped = fingerprints([a, a.clone()]), fingerprints([a.flip(0)])
    assert same[0] == same[1]
    assert flipped[0][:2] == pytest.approx(same[0][:2]) and flipped[0][3] != same[0][3]


def test_compile_takes_and_records_the_batch_options():
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    compiled = tidal.compile(model, (x,), batch="local", check_batch=False)
    assert (compiled.context.batch, compiled.context.check_batch) == ("local", False)
    assert (tidal.compile(model, (x,)).context.batch, compiled.context.batch_size) == ("global", 4)
    with pytest.raises(ValueError, match="compile\\(batch='rows'\\): batch is one of"):
        tidal.compile(model, (x,), batch="rows")
    with pytest.raises(TypeError, match="check_batch"):
        check_batch_options("global", "yes")
