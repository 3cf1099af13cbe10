"""Runs of every plan kind on gloo ranks, traced for the simulator's composition check.

One spawned job of ``world`` ranks runs a small model under each plan kind (data parallel,
compression, burst, tick_tock, round_robin, layer groups, and a data-parallel foreground with a
background job on each rank's scheduler) and returns, per kind, each rank's Program (the objects
the executor ran) and, per repeat, the ranks' traces put on one clock
(``tidal.sim.composition.on_one_clock``). Used by ``tests/test_sim_composition.py`` and
``benchmarks/sim_validation.py``.

Models (:data:`WORKLOADS`): ``mlp`` (a tiny MLP), two plain ``torch.nn`` models of the
third-party matrix (``tests/third_party/models.py``): ``nn_mha`` and ``nn_transformer``, and
two in-repo image classifiers with BatchNorm (``examples.models.ZOO``): ``vgg16_small`` and
``resnet50_small``, at the batch asked for.

    >>> sorted(WORKLOADS)
    ['mlp', 'nn_mha', 'nn_transformer', 'resnet50_small', 'vgg16_small']
    >>> x, y = workload_data("nn_mha", 0, 8)
    >>> tuple(x.shape), tuple(y.shape)
    ((8, 8, 16), (8,))
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402

KINDS = ("data parallel", "compression", "burst", "tick_tock", "round_robin", "layer groups",
         "foreground + background")
BACKGROUND = KINDS[-1]
WARMUP = 2
"""Steps (iterations) of each kind run before the traced ones."""


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _mha() -> nn.Module:
    from tests.third_party.models import MHAModel
    return MHAModel()


def _transformer() -> nn.Module:
    from tests.third_party.models import TransformerClassifier
    return TransformerClassifier()


def _features(g: torch.Generator, batch: int) -> torch.Tensor:
    return torch.randn(batch, 16, generator=g)


def _sequences(g: torch.Generator, batch: int) -> torch.Tensor:
    from tests.third_party.models import SEQ
    return torch.randn(batch, SEQ, 16, generator=g)


def _tokens(g: torch.Generator, batch: int) -> torch.Tensor:
    from tests.third_party.models import SEQ, VOCAB
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def _zoo(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from examples.models import ZOO
        return ZOO[name]()
    return build


def _images(name: str) -> Callable[[torch.Generator, int], torch.Tensor]:
    """Random images of the in-repo image classifier ``name``'s shape."""
    def images(g: torch.Generator, batch: int) -> torch.Tensor:
        from examples.models import ZOO
        m = ZOO[name]()
        return torch.randn(batch, m.in_channels, m.input_size, m.input_size, generator=g)
    return images


WORKLOADS: dict[str, tuple[Callable[[], nn.Module], Callable, int]] = {
    "mlp": (_mlp, _features, 4),
    "nn_mha": (_mha, _sequences, 3),
    "nn_transformer": (_transformer, _tokens, 3),
    "vgg16_small": (_zoo("vgg16_small"), _images("vgg16_small"), 10),
    "resnet50_small": (_zoo("resnet50_small"), _images("resnet50_small"), 10),
}
"""name: (model builder, inputs of (generator, batch), classes)."""


def workload_model(name: str) -> nn.Module:
    """The model ``name`` of :data:`WORKLOADS`, seeded (the same weights on every rank),
    in train mode (no dropout in any of them)."""
    if name not in WORKLOADS:
        raise ValueError(f"sim_runs: unknown model {name!r}; one of {sorted(WORKLOADS)}")
    torch.manual_seed(0)
    return WORKLOADS[name][0]()


def workload_data(name: str, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of model ``name``: (inputs, class targets)."""
    _, inputs, classes = WORKLOADS[name]
    g = torch.Generator().manual_seed(step)
    return inputs(g, batch), torch.randint(0, classes, (batch,), generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def cluster(world: int) -> "tidal.Cluster":
    """The cluster the plans are compiled for (its figures only shape the plans)."""
    return tidal.Cluster(gpus=world, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)


def _burst_pass(name: str, batch: int, world: int):
    """A hand-written burst plan: the first half of the layers on every rank, the rest on
    half of them."""
    from tidal.ir import cost
    from tidal.passes.burst_parallel import BurstParallel, build_problem
    from tidal.passes.burst_planner import plan_from_counts

    x, _ = workload_data(name, 0, batch)
    gm = tidal.trace(workload_model(name), (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, cluster(world), batch)
    n = len(problem.names)
    return BurstParallel(plan=plan_from_counts(
        problem, [world if i < n // 2 else max(1, world // 2) for i in range(n)]).to_json())


def _passes(kind: str, name: str, batch: int, world: int, store: Optional[str] = None):
    from tidal.passes.compression import CompressionPass
    from tidal.passes.layer_groups import LayerGroups
    from tidal.passes.round_robin import RoundRobin
    from tidal.passes.tick_tock import TickTock

    return {"data parallel": lambda: [CompressionPass(mode="off")],
            "compression": lambda: [CompressionPass(compressor="topk:0.5")],
            "burst": lambda: [_burst_pass(name, batch, world)],
            "tick_tock": lambda: [TickTock(ranks=world)],
            "round_robin": lambda: [RoundRobin(partitions=world)],
            "layer groups": lambda: [LayerGroups(grouping="per_layer",
                                                 weight_store=store)]}[kind]()


def _origin(backend) -> float:
    """The zero of ``backend``'s clock on the machine's monotonic clock."""
    return time.perf_counter() * 1e6 - backend.now_us()


def _args(kind: str, name: str, step: int, batch: int):
    x, y = workload_data(name, step, batch)
    return (x, y) if kind == "tick_tock" else ((x,), y)


def _compiled(kind: str, name: str, batch: int, world: int, store: Optional[str]):
    x, y = workload_data(name, 0, batch)
    return tidal.compile(workload_model(name), x if kind == "tick_tock" else (x,),
                         passes=_passes(kind, name, batch, world, store),
                         cluster=cluster(world), example_targets=y,
                         loss_fn=nn.functional.cross_entropy, optimizer=_sgd)


def _stepped(kind: str, name: str, batch: int, world: int, store: Optional[str],
             repeats: int):
    """``WARMUP`` steps of ``kind``, then ``repeats`` traced ones: (program, [trace per
    repeat], clock origin, (program class, fallback reason), [the step's host time outside
    its pieces per repeat, us]). Layer groups: a fresh compile per repeat, its first step
    traced (the one that loads the groups from ``store``)."""
    traces, outside = [], []
    for _ in range(repeats if kind == "layer groups" else 1):
        c = _compiled(kind, name, batch, world, store)
        steps = 1 if kind == "layer groups" else WARMUP + repeats
        for step in range(steps):
            t0 = time.perf_counter()
            c.step(*_args(kind, name, step, batch))
            wall_us = (time.perf_counter() - t0) * 1e6
            if step >= steps - (1 if kind == "layer groups" else repeats):
                traces.append(list(c.executor.last_trace))
                outside.append(wall_us - _span_us(traces[-1]))
    ex = c.executor
    return (ex.last_program, traces, _origin(ex.runner.backend),
            (type(ex.rank_program).__name__, getattr(ex, "fallback_reason", "")), outside)


def _span_us(trace) -> float:
    """From a step trace's first piece start to its last end (its asynchronous work too)."""
    return (max(t.end_us if t.done_us is None else max(t.end_us, t.done_us) for t in trace)
            - min(t.start_us for t in trace))


def _with_background(name: str, batch: int, repeats: int):
    """A data-parallel foreground beside a background job (an MLP, this rank alone) on one
    scheduler sharing the CPU as one device: the foreground's program (its pieces and the
    job's ``loss`` host piece), its traced iterations' traces (after ``WARMUP``), the clock's
    origin and the background job's spans."""
    from tidal.ir.program import COMM, HOST, Piece, Program
    from tidal.runtime.backend import CpuBackend
    from tidal.runtime.program import PieceTrace
    from tidal.runtime.scheduler import Runtime

    x, y = workload_data(name, 0, batch)
    # check_batch=False: the background job is a plain (graph) program, whose batch check is
    # an exchange of its own when the scheduler binds an iteration (the data-parallel
    # foreground's rides on its loss all-reduce): a collective on the binding thread, which
    # binds the two jobs in a timing-dependent order
    fg = tidal.compile(workload_model(name), (x,), passes=_passes("data parallel", name, batch, 1),
                       loss_fn=nn.functional.cross_entropy, optimizer=_sgd, check_batch=False)
    bx, by = workload_data("mlp", 0, batch)
    bg = tidal.compile(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), (bx,),
                       loss_fn=nn.functional.cross_entropy, optimizer=_sgd, check_batch=False)
    fg.step((x,), y)  # binds (and captures) the program of this shape
    program = fg.executor.last_program
    fg_batches = lambda i: ((workload_data(name, i, batch)[0],),  # noqa: E731
                            workload_data(name, i, batch)[1])
    bg_batches = lambda i: ((workload_data("mlp", i, batch)[0],),  # noqa: E731
                            workload_data("mlp", i, batch)[1])
    iterations = WARMUP + repeats
    with Runtime(backend=CpuBackend(slots=1), idle_only=True, be_depth=2) as rt:
        rt.submit(fg.job(fg_batches, iterations=iterations), priority="high")
        rt.submit(bg.job(bg_batches, name="extra", iterations=2 * iterations), priority="low")
        stats = rt.run(until="all")
        origin = _origin(rt.backend)
    failed = {job: s.error for job, s in stats.items() if s.error is not None}
    if failed:  # a job that failed says why, not as missing records
        raise RuntimeError(f"sim_runs: the {BACKGROUND} run failed: {failed}")
    pieces = program.pieces + (Piece("loss", COMM, tuple(range(len(program.pieces))),
                                     kind=HOST),)
    traces = [[PieceTrace(r.piece, r.stream, r.start_us, r.end_us)
               for r in sorted((r for r in rt.trace if r.job == "train" and r.iteration == it),
                               key=lambda r: r.index)]
              for it in range(WARMUP, iterations)]
    background = [(r.piece, r.stream, r.start_us, r.end_us) for r in rt.trace
                  if r.job == "extra"]
    return Program(pieces, program.world), traces, origin, background


def run_kinds(rank: int, world: int, name: str, batch: int, store: Optional[str],
              kinds: Sequence[str], repeats: int) -> dict:
    """One rank's runs (``spawn``'s worker): ``{kind: (program, [trace per repeat], clock
    origin, extra)}``; the foreground + background kind first (a fresh process group)."""
    torch.set_num_threads(1)
    out = {}
    if BACKGROUND in kinds:
        out[BACKGROUND] = _with_background(name, batch, repeats)
    out.update({kind: _stepped(kind, name, batch, world, store, repeats)
                for kind in kinds if kind != BACKGROUND})
    return out


def write_store(name: str, batch: int, folder: Path) -> str:
    """Model ``name``'s layer groups written to a weight store in ``folder``; its path."""
    from tidal.passes.layer_groups import LayerGroups
    from tidal.runtime.weights.loader import write_groups

    path = str(Path(folder) / f"groups_{name}.safetensors")
    write_groups(tidal.compile(workload_model(name), (workload_data(name, 0, batch)[0],),
                               passes=[LayerGroups(grouping="per_layer")]).graph_module, path)
    return path


@dataclass(frozen=True)
class KindRun:
    """One plan kind's run: the ranks' programs, per repeat the ranks' traces on one clock,
    per rank what else the run returned (program class and fallback reason; for the
    foreground + background kind, the background job's spans) and, every rank's and repeat's,
    ``Compiled.step``'s host time outside its pieces (us; binding the batch, its checks: the
    wall time less the trace's span; empty for the foreground + background kind)."""

    programs: dict
    traces: list
    extra: dict
    outside_us: tuple = ()


def run(world: int, name: str, batch: int, folder: Path, kinds: Sequence[str] = KINDS,
        repeats: int = 1, timeout_s: float = 900) -> dict[str, KindRun]:
    """Every kind of ``kinds`` run on ``world`` gloo ranks (one spawned job) with model
    ``name`` at global batch ``batch``: ``{kind: KindRun}``. ``folder``: where the layer
    groups' weight store is written."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"sim_runs.run: unknown plan kind(s) {unknown}; of {KINDS}")
    store = write_store(name, batch, folder) if "layer groups" in kinds else None
    ranks = spawn(run_kinds, world, name, batch, store, tuple(kinds), repeats,
                  timeout_s=timeout_s)
    return collect(ranks, kinds, repeats)


def collect(ranks: Sequence[dict], kinds: Sequence[str] = KINDS, repeats: int = 1
            ) -> dict[str, KindRun]:
    """:func:`run_kinds`'s results of every rank (``spawn``'s list) as ``{kind: KindRun}``,
    each repeat's traces on one clock."""
    from tidal.sim.composition import on_one_clock

    world = len(ranks)
    out = {}
    for kind in kinds:
        programs = {r: ranks[r][kind][0] for r in range(world)}
        origins = {r: ranks[r][kind][2] for r in range(world)}
        traces = [on_one_clock({r: ranks[r][kind][1][i] for r in range(world)}, origins)
                  for i in range(repeats)]
        outside = tuple(us for r in range(world) for us in
                        (ranks[r][kind][4] if len(ranks[r][kind]) > 4 else ()))
        out[kind] = KindRun(programs, traces, {r: ranks[r][kind][3] for r in range(world)},
                            outside)
    return out
