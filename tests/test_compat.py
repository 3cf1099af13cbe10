"""``tidal.ir.compat``: each torch API newer than the floor ``setup.cfg`` names, with the newer API
removed (monkeypatch, or deleted inside a spawned rank), gives what the newer API gives; and no
code outside ``ir/compat.py`` names those APIs."""
from __future__ import annotations

import configparser
import inspect
import operator
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.passes.split_module as split_module_mod

import tidal
from tidal.ir import compat
from tidal.passes.round_robin import RoundRobin
from tidal.runtime.comm.compressors import ALL_GATHER, ALL_REDUCE, Comm, Message

from rank_parts import part, spawn_parts

ROOT = Path(__file__).resolve().parents[1]
NEWER = ("all_gather_single", "tuple_return", "forward_sync_buffers")
"""The newer torch names only ``ir/compat.py`` may use."""
REAL_SPLIT = split_module_mod.split_module
HAS_TUPLE_RETURN = "tuple_return" in inspect.signature(REAL_SPLIT).parameters


def _split_without_tuple_return(m, root_m, split_callback, qualname_map=None,
                                keep_original_order=False, keep_original_node_name=False,
                                keep_original_input_name=True, *, partition_affix=None):
    """torch 2.11's ``split_module`` signature (no ``tuple_return``: passing it is a
    TypeError), running this torch's ``split_module``."""
    return REAL_SPLIT(m, root_m, split_callback, qualname_map, keep_original_order,
                      keep_original_node_name, keep_original_input_name,
                      partition_affix=partition_affix)


class _Net(torch.nn.Module):
    """Partitions with one output, with two, a parameter read through ``get_attr`` and two
    graph outputs."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                                  torch.nn.Linear(4, 2))
        self.pos = torch.nn.Parameter(torch.ones(4))

    def forward(self, x, y):
        h = self.a(x) + self.pos
        k = self.b(torch.relu(h)) + h
        return self.c(k) + y.sum(), k


def _parts(node: fx.Node) -> int:
    return {"a": 0, "add": 0, "relu": 0, "b": 1, "add_1": 1}.get(node.name, 2)


def _split(keep_original_order: bool):
    torch.manual_seed(0)
    model = _Net()
    gm = fx.symbolic_trace(model)
    return gm, compat.split_module_tuple(gm, model, _parts,
                                         keep_original_order=keep_original_order)


def _codes(split: fx.GraphModule) -> list[str]:
    return [split.code] + [split.get_submodule(f"submod_{p}").code for p in range(3)]


@pytest.mark.parametrize("keep_original_order", [False, True])
def test_split_module_tuple_without_tuple_return_makes_what_tuple_return_makes(
        keep_original_order, monkeypatch):
    gm, newer = _split(keep_original_order)
    monkeypatch.setattr(split_module_mod, "split_module", _split_without_tuple_return)
    with pytest.raises(TypeError, match="tuple_return"):
        split_module_mod.split_module(gm, gm, _parts, tuple_return=True)
    _, older = _split(keep_original_order)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for split in (newer, older):
        for p in range(3):   # every submodule returns a tuple, one output or several
            out = next(n for n in split.get_submodule(f"submod_{p}").graph.nodes
                       if n.op == "output")
            assert isinstance(out.args[0], tuple), (p, split.code)
        for got, want in zip(split(x, y), gm(x, y)):
            assert torch.equal(got, want)
    if HAS_TUPLE_RETURN:     # the newer API itself: the fallback's graphs are the same code
        assert _codes(older) == _codes(newer)
    single = [n for n in older.graph.nodes if n.op == "call_module"
              and all(u.target is operator.getitem for u in n.users)]
    assert len(single) == 3


def test_split_module_tuple_calls_tuple_return_where_torch_has_it(monkeypatch):
    seen = []

    def newer(*args, tuple_return=False, **kwargs):
        seen.append(tuple_return)
        return _split_without_tuple_return(*args, **kwargs)

    monkeypatch.setattr(split_module_mod, "split_module", newer)
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    compat.split_module_tuple(gm, gm, lambda n: 0)
    assert seen == [True]


def test_round_robin_trains_alike_without_tuple_return(monkeypatch):
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        c = tidal.compile(model, (torch.randn(4, 8),), passes=[RoundRobin(partitions=2)],
                          loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        losses = [float(c.step((x,), y)) for _ in range(2)]
        return losses, [p.detach().clone() for p in model.parameters()]

    losses, params = run()
    monkeypatch.setattr(split_module_mod, "split_module", _split_without_tuple_return)
    losses_211, params_211 = run()
    assert losses_211 == losses
    assert all(torch.equal(a, b) for a, b in zip(params, params_211))


def test_all_gather_picks_the_newer_name_else_the_torch_2_11_one(monkeypatch):
    assert compat.all_gather_into_tensor() is getattr(dist, "all_gather_single",
                                                      dist.all_gather_into_tensor)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    assert compat.all_gather_into_tensor() is dist.all_gather_into_tensor


class _DDP211:
    """torch 2.11's DDP keywords: no ``forward_sync_buffers``."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True):
        pass


def test_no_buffer_sync_picks_the_keyword_ddp_takes():
    class DDPNew(_DDP211):
        def __init__(self, module, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    assert compat.no_buffer_sync(_DDP211) == {"broadcast_buffers": False}
    assert compat.no_buffer_sync(DDPNew) == {"forward_sync_buffers": False}
    ddp = torch.nn.parallel.DistributedDataParallel
    assert compat.no_buffer_sync() == compat.no_buffer_sync(ddp)
    assert set(compat.no_buffer_sync()) <= set(inspect.signature(ddp).parameters)


def _without(name: str, fn, *args):
    """``fn(*args)`` with ``torch.distributed.<name>`` removed for the call (in a spawned rank:
    no monkeypatch there), and the function compat picked meanwhile."""
    saved = dist.__dict__.pop(name, None)
    try:
        return fn(*args), compat.all_gather_into_tensor().__name__
    finally:
        if saved is not None:
            setattr(dist, name, saved)


def _gather(rank, world):
    """Comm's all-gathers (bytes: int16 and float payloads) and a plain all-gather, with the
    newer name and without it."""
    def run():
        levels = torch.tensor([-200, rank, 300], dtype=torch.int16)
        (summed,), (values, gathered) = Comm().run(
            [Message((torch.full((3,), float(rank + 1)),), ALL_REDUCE),
             Message((torch.full((2,), rank + 0.5), levels), ALL_GATHER)])
        out = torch.empty(world * 2)
        compat.all_gather_into_tensor()(out, torch.full((2,), float(rank)))
        return [t.tolist() for t in (summed, values, gathered, out)]

    newer = (run(), compat.all_gather_into_tensor().__name__)
    return newer, _without("all_gather_single", run)


def _ddp_buffers(rank, world):
    """A DDP model with a BatchNorm buffer, its keyword from no_buffer_sync with and without
    forward_sync_buffers: the forward's output and the buffers each rank keeps."""
    def run(kwargs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        outs = []
        for step in range(2):
            torch.manual_seed(10 * rank + step)   # each rank its own data
            outs.append(ddp(torch.randn(4, 3)).sum().item())
        return outs, model[1].running_mean.tolist()

    newer, fallback = compat.no_buffer_sync(), compat.no_buffer_sync(_DDP211)
    return (newer, run(newer)), (fallback, run(fallback))


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_parts(2, [part(_gather), part(_ddp_buffers)])


def test_all_gather_without_the_newer_name_gathers_the_same_on_two_gloo_ranks(two_ranks):
    for rank, (newer, older) in enumerate(two_ranks["_gather"]):
        assert older[1] == "all_gather_into_tensor"
        assert newer[1] == ("all_gather_single" if hasattr(dist, "all_gather_single")
                            else "all_gather_into_tensor")
        assert newer[0] == older[0]
        summed, values, gathered, out = older[0]
        assert summed == [3.0] * 3
        assert values == [[0.5, 0.5], [1.5, 1.5]]
        assert gathered == [[-200, 0, 300], [-200, 1, 300]]
        assert out == [0.0, 0.0, 1.0, 1.0]


def test_ddp_without_forward_sync_buffers_keeps_each_ranks_buffers_alike(two_ranks):
    ranks = two_ranks["_ddp_buffers"]
    for (kw_newer, newer), (kw_older, older) in ranks:
        assert kw_older == {"broadcast_buffers": False}
        assert list(kw_newer.values()) == [False]
        assert newer == older      # same outputs and buffers either way
    (_, (_, mean0)), (_, (_, mean1)) = (r[1] for r in ranks)
    assert mean0 != mean1          # no buffer broadcast: each rank keeps its own statistics


def _source_files():
    """(path relative to the root, path) of every text file of the project outside tests/
    (hidden folders but .ci, virtual environments and build outputs left out)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in ("tests", "__pycache__", "build", "dist")
                         and (not d.startswith(".") or d == ".ci") and "venv" not in d
                         and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder, name)
            if path.suffix in (".py", ".md", ".cfg", ".toml", ".txt") or name in ("Makefile",
                                                                                 "run"):
                yield path.relative_to(ROOT).as_posix(), path


def test_newer_torch_names_appear_only_in_ir_compat():
    pattern = re.compile("|".join(NEWER))
    found = [f"{rel}:{i}: {line.strip()}" for rel, path in _source_files()
             if rel != "ir/compat.py"
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert not found, "newer torch APIs outside ir/compat.py:\n" + "\n".join(found)
    compat_text = (ROOT / "ir" / "compat.py").read_text()
    assert all(name in compat_text for name in NEWER)


def test_setup_cfg_names_a_torch_floor_of_at_most_2_11():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options"]["install_requires"].split("\n") if r.strip()]
    (torch_req,) = [r for r in reqs if re.match(r"torch\b", r)]
    floor = re.fullmatch(r"torch>=(\d+)\.(\d+)(?:\.\d+)?", torch_req)
    assert floor, torch_req
    assert (int(floor[1]), int(floor[2])) <= (2, 11)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert (major, minor) >= (int(floor[1]), int(floor[2])), "this torch is below the floor"
