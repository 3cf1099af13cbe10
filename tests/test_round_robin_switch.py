"""round_robin switches partitions for real on gloo ranks (Wavelet §3.3, Fig. 10): a rank keeps
resident only the partition it computes and the one it prefetches; a switch moves weights,
accumulated gradients and optimizer state out to a per-rank store and back, bit for bit,
keeping the tensors' identity. Checked on the rank's own tensors after every piece of a step,
on 2 and 4 ranks, with the step still equal to single-process micro-batch training."""
import copy

import pytest
import torch

import tidal
from tidal.passes.round_robin import RoundRobin
from tidal.runtime.distributed import spawn
from tidal.runtime.weights.residency import PartitionResidency, ResidencyError


# -- the store, in one process --------------------------------------------------------------
def _three_partitions():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)]
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(layers[2](layers[1](layers[0](torch.randn(4, 6)))),
                                      torch.tensor([0, 1, 2, 0])).backward()
    opt.step()  # gradients and a momentum buffer per parameter
    return layers, opt, [[(f"{i}.{k}", p) for k, p in m.named_parameters()]
                         for i, m in enumerate(layers)]


def _state(layers, opt):
    """Every tensor of the training state, copied, by name."""
    out = {}
    for i, m in enumerate(layers):
        for k, p in m.named_parameters():
            out[f"{i}.{k}"] = p.detach().clone()
            out[f"{i}.{k}.grad"] = p.grad.clone()
            out[f"{i}.{k}.momentum"] = opt.state[p]["momentum_buffer"].clone()
    return out


def test_switch_moves_weights_gradients_and_optimizer_state_bit_for_bit():
    layers, opt, parts = _three_partitions()
    before, params = _state(layers, opt), [p for _, p in sum(parts, [])]
    view = layers[0].weight.t()  # a view, as a captured graph keeps between F and B
    res = PartitionResidency(parts, opt, rank=2)
    whole = res.resident_bytes()
    assert whole == 3 * sum(p.numel() * 4 for p in params)

    moved = res.switch({1})
    assert moved.loaded == 0 and moved.evicted == 3 * 4 * sum(
        p.numel() for m in (layers[0], layers[2]) for p in m.parameters())
    assert res.resident_partitions() == [1] and res.resident == {1}
    for m in (layers[0], layers[2]):
        for p in m.parameters():
            assert p.untyped_storage().nbytes() == 0 and p.shape == before[
                next(k for k, q in sum(parts, []) if q is p)].shape
            assert p.grad.untyped_storage().nbytes() == 0
            assert opt.state[p]["momentum_buffer"].untyped_storage().nbytes() == 0
    assert res.resident_bytes() == 3 * 4 * sum(p.numel() for p in layers[1].parameters())

    res.switch({0, 2})
    assert res.resident_partitions() == [0, 2]
    res.load_all()
    assert res.resident_partitions() == [0, 1, 2] and res.resident_bytes() == whole
    assert [p for g in opt.param_groups for p in g["params"]] == params  # the same objects
    assert set(map(id, opt.state)) == set(map(id, params))
    torch.testing.assert_close(_state(layers, opt), before, rtol=0, atol=0)
    assert torch.equal(view, before["0.weight"].t())  # the view reads the loaded bytes


def test_a_tied_parameter_stays_while_a_partition_using_it_is_resident():
    shared = torch.nn.Parameter(torch.ones(4))
    a, b, c = (torch.nn.Parameter(torch.full((3,), float(i))) for i in range(3))
    res = PartitionResidency([[("a", a), ("tied", shared)], [("b", b)], [("c", c),
                                                                         ("tied", shared)]])
    res.switch({1, 2})  # partition 0 goes, the tied parameter stays for partition 2
    assert res.resident_partitions() == [1, 2] and shared.untyped_storage().nbytes() == 16
    res.switch({1})
    assert shared.untyped_storage().nbytes() == 0 and res.resident_partitions() == [1]
    res.switch({0})
    assert res.resident_partitions() == [0] and torch.equal(shared, torch.ones(4))


def test_a_missing_store_entry_and_an_evicted_partition_are_named():
    layers, opt, parts = _three_partitions()
    PartitionResidency(parts, opt, rank=0).switch({0})   # this store is then lost
    res = PartitionResidency(parts, opt, rank=3)          # believes all resident
    res.switch({0})  # nothing to copy: partitions 1 and 2 hold no bytes
    with pytest.raises(ResidencyError, match="rank 3: U2 needs partition 2, which is not"):
        res.require(2, "U2")
    with pytest.raises(ResidencyError, match=r"rank 3 cannot load partition 1: 1\.weight holds "
                                             "no data and the store has no copy of it"):
        res.switch({0, 1})


# -- on gloo ranks ----------------------------------------------------------------------------
class _Tied(torch.nn.Module):
    """The input layer's weight used again, transposed, by the output layer (first and last
    partition share it)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.mid = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.out_bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for m in self.mid:
            h = torch.tanh(m(h))
        return torch.nn.functional.linear(h, self.inp.weight.t(), self.out_bias)


class _Gate(torch.nn.Module):
    """Data-dependent control flow: its partition runs eagerly with autograd."""

    def forward(self, x):
        return x * 2 if float(x.detach().sum()) > 0 else x - 1


def _mlp():
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 3))


def _gated():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               _Gate(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


CASES = {  # name: (model, classes, optimizer, compile options)
    "mlp_adam": (_mlp, 3, lambda ps: torch.optim.Adam(ps, lr=0.01), {}),
    "tied_momentum": (_Tied, 8, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),
    "eager_adam": (_gated, 3, lambda ps: torch.optim.Adam(ps, lr=0.01),
                   {"leaf_modules": [_Gate]}),
}


def _watch(program):
    """After every piece of every step: the partitions whose parameters hold bytes, read from
    the rank's tensors (the piece's name with them)."""
    seen = []
    bind = program.bind

    def watched(*args, **kwargs):
        step = bind(*args, **kwargs)
        work = step.work

        def checked(index, piece):
            fn = work(index, piece)

            def run():
                out = fn()
                seen.append((piece.name, tuple(program.resident_partitions())))
                return out
            return run
        step.work = checked
        return step
    program.bind = watched
    return seen


def _train(name, world):
    """Two steps of case ``name`` under round_robin and on one process; what each rank saw."""
    make, classes, optimizer, options = CASES[name]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2 * world, 8, generator=g)
    y = torch.randint(0, classes, (2 * world,), generator=g)
    loss_fn = torch.nn.functional.cross_entropy
    c = tidal.compile(model, (x,), passes=[RoundRobin(partitions=world)], loss_fn=loss_fn,
                      optimizer=optimizer, **options)
    ref_opt = optimizer(list(ref.parameters()))
    seen = _watch(c.executor.rank_program)
    losses = []
    for _ in range(2):
        losses.append(float(c.step((x,), y)))
        ref_opt.zero_grad(set_to_none=True)
        want = 0.0
        for xb, yb in zip(x.chunk(world), y.chunk(world)):
            loss = loss_fn(ref(xb), yb) / world
            loss.backward()
            want += float(loss)
        losses.append(want)
        ref_opt.step()
    program = c.executor.rank_program
    with torch.no_grad():
        outputs = (c(x), ref(x))
    return dict(
        losses=losses, seen=seen, stats=dict(program.stats), notes=program.step_notes(),
        report=c.report(), after=program.resident_partitions(), outputs=outputs,
        fallback=program.fallback_reason,
        params={k: (p.detach().clone(), q.detach().clone()) for (k, p), q in
                zip(model.named_parameters(), ref.parameters())},
        grads={k: (p.grad.clone(), q.grad.clone()) for (k, p), q in
               zip(model.named_parameters(), ref.parameters())})


def _rank_job(rank, world):
    return {name: _train(name, world) for name in CASES}


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def ranks(request):
    """One spawned job per world size, every case in it: (world, per-rank results)."""
    return request.param, spawn(_rank_job, request.param)


def test_steps_equal_one_process_training_with_the_state_switched(ranks):
    """Parameters, gradients and loss after two steps of a stateful optimizer (Adam, SGD with
    momentum) equal one-process micro-batch training; the model is whole after the step:
    ``compiled(x)`` matches, every partition resident."""
    world, results = ranks
    for rank, r in enumerate(results):
        for name, got in r.items():
            where = f"rank {rank} {name}"
            got_loss, want_loss = got["losses"][0::2], got["losses"][1::2]
            assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6), where
            for k, (p, q) in got["params"].items():
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{where} {k}")
            for k, (p, q) in got["grads"].items():
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{where} {k}")
            torch.testing.assert_close(*got["outputs"], rtol=1e-5, atol=1e-6, msg=where)
            assert got["after"] == list(range(world)), where
        assert r["eager_adam"]["fallback"].startswith("partition"), r["eager_adam"]["fallback"]
    for name in CASES:  # every rank holds identical copies
        for k, (p, _) in results[0][name]["params"].items():
            for r in results[1:]:
                torch.testing.assert_close(r[name]["params"][k][0], p, rtol=0, atol=0)


def test_a_rank_never_holds_more_than_two_partitions(ranks):
    """Read from the rank's tensors after every piece of both steps: at most two partitions'
    parameters hold bytes, the switch to p keeps p and the partition computed before it (the
    first switch the next one), so that 4 ranks hold partitions 0-1, 1-2, 2-3 and back; only
    the step's last piece, ``restore``, loads them all."""
    world, results = ranks
    want = {2: {"S0": (0, 1), "S1": (0, 1), "S0 bwd": (0, 1)},
            4: {"S0": (0, 1), "S1": (0, 1), "S2": (1, 2), "S3": (2, 3), "S2 bwd": (2, 3),
                "S1 bwd": (1, 2), "S0 bwd": (0, 1)}}[world]
    for rank, r in enumerate(results):
        for name, got in r.items():
            where = f"rank {rank} {name}"
            during = [(piece, held) for piece, held in got["seen"] if piece != "restore"]
            assert max(len(held) for _, held in during) <= 2, (where, during)
            assert {piece: held for piece, held in during if piece.startswith("S")} == want
            assert [held for piece, held in got["seen"] if piece == "restore"] == [
                tuple(range(world))] * 2, where
            for piece, held in during:  # a piece's own partition is resident when it ends
                if piece[0] in "FBU":
                    assert int(piece[1:].split(",")[0]) in held, (where, piece, held)


def test_stats_report_resident_bytes_against_the_whole_model_and_the_switch_cost(ranks):
    world, results = ranks
    for rank, r in enumerate(results):
        for name, got in r.items():
            s, where = got["stats"], f"rank {rank} {name}"
            assert s["steps"] == 2 and s["switches"] == 2 * (2 * world - 1), where
            assert s["resident_peak_partitions"] == 2, where
            assert s["whole_model_bytes"] > 0 and s["update_us"] > 0, where
            if world == 2:  # two partitions are the whole model: nothing to move
                assert s["resident_peak_bytes"] == s["whole_model_bytes"], where
                assert s["step_switch_bytes"] == s["switch_bytes"] == s["restore_bytes"] == 0
            else:
                assert s["resident_peak_bytes"] < s["whole_model_bytes"], where
                assert s["step_switch_bytes"] > s["restore_bytes"] > 0, where
                assert s["switch_bytes"] > s["step_switch_bytes"] and s["switch_us"] > 0
            [line] = got["notes"]
            assert line.startswith(f"round_robin: rank {rank} held at most 2 of {world} "
                                   "partitions resident: "), line
            assert "switches moved" in line and f"runtime: {line}" in got["report"]
