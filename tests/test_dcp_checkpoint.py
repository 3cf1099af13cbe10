"""A DCP checkpoint of a burst_parallel run on two gloo ranks (owner-only optimizer state: a
rank holds AdamW's state only for the layers it runs) loads on one process, and training goes
on exactly as the two ranks did (float64, ≤ 1e-9): tidal.compiler.checkpoint's get_state_dict
refreshes the stale copies first and keys the optimizer state by parameter name.

The runtime state (tick_tock's second wave, PowerSGD's residuals and warm starts) goes through
the same ``dcp.save`` with ``get_runtime_state_dict`` and comes back with
``set_runtime_state_dict``: the resumed step equals the uninterrupted one bit for bit; per-rank
entries sit under rank keys, and loading them on another world size raises. One spawned job.
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import tidal
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tidal.compiler import checkpoint
from tidal.passes.compression import CompressionPass
from tidal.passes.tick_tock import TickTock
from tidal.runtime.distributed import spawn

from test_open_step_burst import _adamw, _compile, _data, _model

TOL = dict(rtol=1e-9, atol=1e-12)


def _burst_then_save(rank, size, path):
    """Two open steps under burst (c1 on rank 0 only), a DCP checkpoint, a third step; the
    model's state after it (current on every rank)."""
    torch.set_default_dtype(torch.float64)
    model = _model()
    c = _compile(model)
    opt, sched = _adamw(model)
    for step in range(3):
        if step == 2:
            model_state, optim_state = checkpoint.get_state_dict(c, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        c.backward(*_data(step, 0))
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in c.state_dict().items()}


RUNTIME_PASSES = {
    "tick_tock": lambda: [TickTock(ranks=2)],
    "powersgd": lambda: [CompressionPass("powersgd:2,min_compression_rate=0")],
}


def _runtime_compile(name):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    c = tidal.compile(model, (torch.randn(8, 8),), passes=RUNTIME_PASSES[name](),
                      loss_fn=F.cross_entropy)
    return c, torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9)


def _runtime_step(c, opt, step):
    g = torch.Generator().manual_seed(step)
    c.backward(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    opt.step()
    opt.zero_grad()


def _runtime_round_trip(name, path):
    """Three open steps with a DCP checkpoint of model, optimizer and runtime state after two;
    a fresh compile loads it and takes the third. Returns (largest parameter difference,
    largest runtime-state difference, the saved runtime dict's sections and their keys)."""
    torch.manual_seed(0)
    c, opt = _runtime_compile(name)
    for step in range(3):
        if step == 2:
            model_state, optim_state = checkpoint.get_state_dict(c, opt)
            runtime = checkpoint.get_runtime_state_dict(c)
            dcp.save({"model": model_state, "optim": optim_state, "runtime": runtime},
                     checkpoint_id=path)
            sections = {k: sorted(v) if isinstance(v, dict) else v for k, v in runtime.items()}
        _runtime_step(c, opt, step)
    torch.manual_seed(1)   # other initial values: everything must come from the checkpoint
    again, opt2 = _runtime_compile(name)
    model_state, optim_state = checkpoint.get_state_dict(again, opt2)
    state = {"model": model_state, "optim": optim_state,
             "runtime": checkpoint.get_runtime_state_dict(again, checkpoint_id=path)}
    dcp.load(state, checkpoint_id=path)
    checkpoint.set_state_dict(again, opt2, model_state_dict=state["model"],
                              optim_state_dict=state["optim"])
    checkpoint.set_runtime_state_dict(again, state["runtime"])
    _runtime_step(again, opt2, 2)
    params = max(float((p - q).abs().max()) for p, q in zip(c.parameters(), again.parameters()))
    flat, flat2 = {}, {}
    checkpoint.flatten(c.runtime_state_dict(), [], flat)
    checkpoint.flatten(again.runtime_state_dict(), [], flat2)
    assert flat.keys() == flat2.keys()
    runtime_diff = max(float((v - flat2[k]).abs().max()) if torch.is_tensor(v)
                       else float(v != flat2[k]) for k, v in flat.items())
    return params, runtime_diff, sections


def _job(rank, size, path):
    """The burst checkpoint (test_a_sharded_burst_checkpoint_resumes_on_one_process) and the
    runtime state's round trips, in one spawned job."""
    final = _burst_then_save(rank, size, path + "/burst")
    torch.set_default_dtype(torch.float32)
    return final, {name: _runtime_round_trip(name, f"{path}/{name}") for name in RUNTIME_PASSES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp"))
    return path, spawn(_job, 2, path, timeout_s=600)


def test_a_sharded_burst_checkpoint_resumes_on_one_process(two_ranks):
    path = two_ranks[0] + "/burst"
    final = [result[0] for result in two_ranks[1]]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    model = _model()   # one process, plain PyTorch: load, then the third step
    opt, sched = _adamw(model)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    assert opt.state[model.c1.weight]["step"] == 2     # rank 0's own share came back
    for _ in range(2):
        sched.step()
    x, y = _data(2, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, final[0][k], **TOL, msg=k)


@pytest.mark.parametrize("name", sorted(RUNTIME_PASSES))
def test_runtime_state_through_dcp_resumes_bit_for_bit(two_ranks, name):
    for rank, (_, runtime) in enumerate(two_ranks[1]):
        params, runtime_diff, sections = runtime[name]
        assert params == 0.0 and runtime_diff == 0.0, (rank, params, runtime_diff)
        assert sections["world_size"] == 2 and f"rank{rank}" in sections
    if name == "powersgd":    # each rank's error-feedback residuals are its own
        own = [s for s in two_ranks[1][0][1][name][2]["rank0"] if s != "rank"]
        assert own and any("residual" in k or "error" in k for k in own), own
    else:                     # tick_tock's tock replica is the same on both ranks
        assert any('"tock"' in k for k in two_ranks[1][0][1][name][2]["shared"])


def test_per_rank_runtime_state_on_another_world_size_raises(two_ranks):
    c, _ = _runtime_compile("powersgd")
    with pytest.raises(checkpoint.RuntimeStateError, match="per-rank runtime state of ranks"):
        checkpoint.get_runtime_state_dict(c, checkpoint_id=two_ranks[0] + "/powersgd")
    state = {"world_size": 2, "shared": {}, "rank0": {"rank": 0, '["x"]': 1}}
    with pytest.raises(checkpoint.RuntimeStateError, match="saved on 2 ranks"):
        checkpoint.set_runtime_state_dict(c, state)


def test_flatten_round_trips_nested_state():
    state = {"a": [torch.ones(2), {}, []], 3: {"x": None, "y": (1, 2)}, "b": {0: [1.5]}}
    flat = {}
    checkpoint.flatten(state, [], flat)
    back = checkpoint.unflatten(flat)
    assert back["a"][1] == {} and back["a"][2] == [] and back[3] == {"x": None, "y": (1, 2)}
    assert torch.equal(back["a"][0], torch.ones(2)) and back["b"] == {0: [1.5]}
