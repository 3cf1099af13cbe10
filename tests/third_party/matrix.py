"""The checks of the third-party matrix: one function per (model, pass) cell, shared by the
tests and by the table script (``python -m tests.third_party.table``).

A cell's check runs the model eagerly and through ``tidal.compile`` and raises
``AssertionError`` when they differ. What each cell is expected to do is in ``EXPECTED``:
``EQUAL`` (the check passes), ``Refuse(error class, regex, reason)`` (compile or step raises
that error, with a message naming the node and the reason), or ``Bug(reason)`` (runs but is
wrong, or fails with a raw torch error: the test is a strict xfail until the library is fixed).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import tidal
from tidal.ir.export_capture import ExportCache, reusing_exports
from tidal.passes.burst_parallel import BurstParallel
from tidal.passes.clustered_attention import ClusteredAttention
from tidal.passes.compression import CompressionPass
from tidal.passes.layer_groups import LayerGroups
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock

from .models import BUILDERS, Case, logits_of

LR = 0.1
FWD_TOL = dict(rtol=1e-4, atol=1e-5)   # float32: the same ops, possibly in another order
STEP_TOL = dict(rtol=1e-4, atol=1e-5)
PASSES = ("none", "burst_parallel", "tick_tock", "round_robin", "compression", "layer_groups",
          "clustered_attention", "auto")
MULTI_RANK = ("burst_parallel", "round_robin", "compression_off", "compression_topk100")


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def cluster(gpus: int) -> "tidal.Cluster":
    """A slow device, so that the tiny models' layers cost more than moving their samples and
    the burst planner has a reason to change GPU counts."""
    return tidal.Cluster(gpus=gpus, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)


# -- expectations --------------------------------------------------------------------------
@dataclass(frozen=True)
class Refuse:
    """The pass cannot apply: compile or step raises ``error`` matching ``match``."""
    error: type
    match: str
    reason: str


@dataclass(frozen=True)
class Bug:
    """The pair runs but is wrong (or fails with a raw torch error): a strict xfail."""
    reason: str


EQUAL = "equal"

EXPECTED: dict = {}
"""(model, pass) -> Refuse or Bug; every other single-process cell is EQUAL."""
EXPECTED_RANKS: dict = {}
"""(model, multi-rank cell) -> Refuse or Bug; every other multi-rank cell is EQUAL."""


def expected(model_name: str, pass_name: str, ranks: bool = False):
    return (EXPECTED_RANKS if ranks else EXPECTED).get((model_name, pass_name), EQUAL)


# -- eager references ----------------------------------------------------------------------
def eager_step(case: Case, model: Optional[torch.nn.Module] = None):
    """One eager SGD step on the global batch, on a deep copy: (loss, the stepped model)."""
    ref = copy.deepcopy(case.model if model is None else model)
    opt = sgd(ref.parameters())
    loss = case.loss_fn(case.call(ref), case.targets)
    loss.backward()
    opt.step()
    return loss.detach(), ref


def assert_same_params(got: torch.nn.Module, want: torch.nn.Module, what: str, **tol) -> None:
    tol = tol or STEP_TOL
    w = dict(want.named_parameters())
    names = [n for n, _ in got.named_parameters()]
    assert names == list(w), f"{what}: parameter names differ"
    for n, p in got.named_parameters():
        torch.testing.assert_close(p.detach(), w[n].detach(), **tol, msg=f"{what}: {n}")


def assert_same_output(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(logits_of(got), logits_of(want), **FWD_TOL, msg=what)


def _compile(case: Case, passes, **kw):
    return tidal.compile(case.model, case.inputs, passes=passes, loss_fn=case.loss_fn,
                         optimizer=sgd, **kw)


def _forward_and_step(case: Case, passes, what: str, step: bool = True, **kw) -> Any:
    """Forward equals eager; with ``step``, one compiled step equals one eager SGD step."""
    with torch.no_grad():
        want = case.call()
    want_loss, ref = eager_step(case)
    c = _compile(case, passes, **kw)
    with torch.no_grad():
        assert_same_output(case.call(c), want, f"{what}: forward")
    if step:
        loss = c.step(case.inputs, case.targets)
        torch.testing.assert_close(torch.as_tensor(loss).detach(), want_loss, **STEP_TOL,
                                   msg=f"{what}: loss")
        assert_same_params(case.model, ref, f"{what}: after one step")
    return c


# -- single-process cells ------------------------------------------------------------------
def _tick_tock(case: Case, what: str) -> Any:
    """Wavelet Eq. 1 in one process, first step: the tick wave (first half of the batch)
    applies its own gradient (no earlier tock gradient yet) to the model's parameters."""
    half = case.targets.shape[0] // 2
    first = copy.copy(case)
    first.inputs = ({k: v[:half] for k, v in case.inputs.items()} if isinstance(case.inputs, dict)
                    else tuple(v[:half] for v in case.inputs))
    first.targets = case.targets[:half]
    _, ref = eager_step(first, case.model)
    c = _compile(case, [TickTock(ranks=1)], example_targets=case.targets)
    loss = c.step(case.inputs, case.targets)
    assert torch.isfinite(torch.as_tensor(loss)).all(), f"{what}: loss {loss}"
    assert_same_params(case.model, ref, f"{what}: tick replica after one step")
    return c


def _clustered(case: Case, what: str) -> Any:
    """One head per cluster equals multi-head attention. Not vacuous: one cluster per layer
    changes the output (after the first tokens). A model without attention the matcher
    recognises is left unchanged, with a note saying so."""
    c = _forward_and_step(case, [ClusteredAttention(clusters=case.heads or 1)], what,
                          step=False)
    plan = c.plan.get("clustered_attention")
    if not case.heads or plan is None:
        assert plan is None, f"{what}: a plan for a model without attention"
        assert any("no attention found" in n for r in c.records for n in r.notes), what
        return c
    assert [layer.num_heads for layer in plan.layers] == case.heads, f"{what}: heads"
    fresh = BUILDERS[case.name]()
    one = _compile(fresh, [ClusteredAttention(clusters=1)])
    with torch.no_grad():  # random weights: nearly uniform attention, so tiny but real changes
        got, want = logits_of(fresh.call(one)), logits_of(fresh.call())
    assert not torch.equal(got, want), f"{what}: clusters=1 changed nothing"
    return c


def check_single(model_name: str, pass_name: str) -> Any:
    """Run one single-process cell; raises AssertionError (or the library's error)."""
    case = BUILDERS[model_name]()
    what = f"{model_name} x {pass_name}"
    if pass_name == "none":
        return _forward_and_step(case, [], what)
    if pass_name == "burst_parallel":  # a plan for 2 GPUs, run in one process: plain training
        return _forward_and_step(case, [BurstParallel(amp_limit=4.0)], what, cluster=cluster(2))
    if pass_name == "tick_tock":
        return _tick_tock(case, what)
    if pass_name == "round_robin":  # 2 partitions in one process: 2-micro-batch accumulation
        return _forward_and_step(case, [RoundRobin(partitions=2)], what)
    if pass_name == "compression":
        return _forward_and_step(case, [CompressionPass(mode="off")], what)
    if pass_name == "layer_groups":
        return _forward_and_step(case, [LayerGroups()], what)
    if pass_name == "clustered_attention":
        return _clustered(case, what)
    if pass_name == "auto":
        return _forward_and_step(case, "auto", what)
    raise KeyError(pass_name)


def proxies_left(model: torch.nn.Module) -> list:
    """Module attributes that hold an fx Proxy (left behind by tracing)."""
    return [f"{name}.{attr}" for name, m in model.named_modules()
            for attr, v in vars(m).items() if isinstance(v, torch.fx.Proxy)]


def check_recompile(model_name: str, exports: Optional[ExportCache] = None) -> Any:
    """Compiling leaves the model as it was: no fx Proxy stored on a module, and a second
    ``tidal.compile`` of the same model works and equals eager. Both compiles export the model
    (nothing reused); the first one's export is kept in ``exports`` for other cells."""
    case = BUILDERS[model_name]()
    with torch.no_grad():
        want = case.call()
    with reusing_exports(exports or ExportCache(), reuse=False):
        _compile(case, [])
    left = proxies_left(case.model)
    assert not left, f"{model_name}: tracing left fx Proxies on the model: {left}"
    c = _compile(case, [])
    with torch.no_grad():
        assert_same_output(case.call(c), want, f"{model_name}: second compile")
        assert_same_output(case.call(), want, f"{model_name}: eager after compiling")
    return c


# -- multi-rank cells (run inside one spawned job per model) -------------------------------
def _rank_cell(case: Case, kind: str, world: int):
    if kind == "burst_parallel":
        return dict(passes=[BurstParallel(amp_limit=4.0)], cluster=cluster(world))
    if kind == "round_robin":
        return dict(passes=[RoundRobin(partitions=world)])
    if kind == "compression_off":
        return dict(passes=[CompressionPass(mode="off")])
    if kind == "compression_topk100":
        return dict(passes=[CompressionPass(compressor="topk:1.0")])
    raise KeyError(kind)


def burst_owned(c: Any, model: torch.nn.Module) -> set:
    """The names of ``model``'s parameters this rank holds after a step of ``c`` compiled with
    ``burst_parallel``: owner-only state, so only the parameters of the layers the rank runs
    (``BurstProgram.owned``); its copies of the others are stale and never read."""
    mine = {id(t) for t in c.executor.owned(c.graph_module).values()}
    return {n for n, p in model.named_parameters() if id(p) in mine}


def _owners_view(c: Any, model: torch.nn.Module) -> list:
    """After a ``burst_parallel`` step, every parameter of ``model`` as this rank reports it:
    its own copy where it owns the parameter (:func:`burst_owned`), else the mean of the
    owners' copies (one all-reduce of the owned values and the owner counts; no owner gives
    NaN). Owners whose copies differ still show up in the ranks' spread."""
    import torch.distributed as dist

    mine = burst_owned(c, model)
    named = list(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) * (n in mine) for n, p in named])
    count = torch.cat([torch.full((p.numel(),), float(n in mine)) for n, p in named])
    both = torch.cat([flat, count])
    dist.all_reduce(both)
    mean = both[:flat.numel()] / both[flat.numel():]
    out, offset = [], 0
    for n, p in named:
        k = p.numel()
        out.append((n, p.detach() if n in mine else mean[offset:offset + k].view_as(p)))
        offset += k
    return out


def _all_ok(ok: bool) -> bool:
    """Whether the cell ran on every rank (a collective: every rank calls it once per cell)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_ranks(rank: int, world: int, model_name: str) -> dict:
    """On every rank: each multi-rank cell of ``model_name`` compiled and stepped once. Returns
    per cell either ``("error", type name, message)`` or ``("ok", max |loss error|, max
    |parameter error| against one eager step on the global batch, the flat parameters)``.
    Under ``burst_parallel`` (owner-only state) the parameters are the rank's own copies of
    those it owns and its owners' mean for the others (:func:`_owners_view`). The model is
    exported once, by its first cell; the others rebuild that export on their fresh model.
    The eager reference step is computed once (every cell's fresh model is the same)."""
    exports = ExportCache()
    reference = eager_step(BUILDERS[model_name]())
    return {kind: _rank_cell_result(model_name, kind, world, exports, reference)
            for kind in MULTI_RANK}


def _rank_cell_result(model_name: str, kind: str, world: int, exports: ExportCache,
                      reference: tuple) -> tuple:
    """One cell of :func:`run_ranks` on a fresh model (its capture reusing ``exports``),
    compared with ``reference``: (loss, model) of one eager step (:func:`eager_step`)."""
    case = BUILDERS[model_name]()
    want_loss, ref = reference
    try:
        with reusing_exports(exports):
            c = _compile(case, **_rank_cell(case, kind, world))
        loss = torch.as_tensor(c.step(case.inputs, case.targets)).detach()
    except Exception as e:  # recorded, compared with EXPECTED by the test
        if kind == "burst_parallel":
            _all_ok(False)
        return ("error", type(e).__name__, str(e)[:2000])
    named = [(n, p.detach()) for n, p in case.model.named_parameters()]
    if kind == "burst_parallel":
        if not _all_ok(True):  # another rank failed: nothing to gather
            return ("error", "RuntimeError", "burst_parallel failed on another rank")
        named = _owners_view(c, case.model)
    w = dict(ref.named_parameters())
    perr = float(torch.stack([(p - w[n].detach()).abs().max() /
                              (1.0 + w[n].detach().abs().max()) for n, p in named]).max())
    flat = torch.cat([p.reshape(-1) for _, p in named])
    return ("ok", float((loss - want_loss).abs()), perr, flat.numpy().copy())


def run_models(rank: int, world: int, model_names: list) -> dict:
    """:func:`run_ranks` for each of ``model_names`` in turn, in one spawned job (one start of
    the ranks for the whole matrix): {model name: its cells' results}. An exception that
    escapes a model's cells (they record their own errors) ends the job, naming the model."""
    out = {}
    for name in model_names:
        try:
            out[name] = run_ranks(rank, world, name)
        except Exception as e:
            raise RuntimeError(f"{name}: {type(e).__name__}: {e}") from e
    return out
