"""``tidal.compile``: trace a model, annotate costs, run the selected passes."""
from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tidal.ir.capture import LeafSpec, trace
from tidal.compiler.compiled import Compiled, OptimizerSpec
from tidal.compiler.pass_manager import PassRecord, run_passes, snapshot
from tidal.ir import cost, meta
from tidal.ir.cluster import Cluster
from tidal.ir.errors import PassError, PlanError
from tidal.ir.inputs import bind_inputs
from tidal.ir.input_check import check_input_dtypes
from tidal.ir.pass_api import BATCH_CONVENTIONS, Pass, PassContext
from tidal.ir.plan import CompiledPlan
from tidal.ir.trace_lock import tracing
from tidal.passes import registry
from tidal.runtime.batch_data import global_batch
from tidal.runtime.comm.compressors.modeling import encode_decode_s

PassSpec = Union[str, Pass]


def _option_names(cls: type) -> set[str]:
    sig = inspect.signature(cls.__init__)
    return {n for n, p in sig.parameters.items()
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def resolve_passes(passes: Union[str, Sequence[PassSpec]], options: Mapping[str, Any],
                   ctx: Optional[PassContext] = None) -> list[Pass]:
    """Turn pass names (or ``"auto"``: every registered pass, filtered later by
    ``auto_select``) and pass objects into pass instances, giving each named pass the
    ``options`` its constructor accepts.
    Raises ``PassError`` for an unknown pass name or an option two named passes take, and
    ``TypeError`` for an option no selected pass takes."""
    reg = registry()
    if isinstance(passes, str):
        if passes != "auto":
            passes = [p.strip() for p in passes.split(",") if p.strip()]
        else:
            passes = list(reg)
    out: list[Pass] = []
    used: set[str] = set()
    named = [s for s in passes if isinstance(s, str) and s in reg]
    for key in options:
        takers = [n for n in named if key in _option_names(reg[n])]
        if len(takers) > 1:
            raise PassError(f"option {key!r} is taken by passes {takers}; give pass objects with "
                            f"their own options instead, e.g. passes=[{reg[takers[0]].__name__}"
                            f"({key}=...), ...]")
    for spec in passes:
        if isinstance(spec, Pass):
            out.append(spec)
            continue
        if not isinstance(spec, str):
            raise TypeError(f"passes must be names or Pass objects, got {type(spec).__name__}")
        if spec not in reg:
            known = ", ".join(sorted(reg)) or "none registered"
            raise PassError(f"unknown pass {spec!r} (known: {known})")
        cls = reg[spec]
        accepted = _option_names(cls) & set(options)
        used |= accepted
        out.append(cls(**{k: options[k] for k in accepted}))
    unused = sorted(set(options) - used)
    if unused:
        takes = {p.name: sorted(_option_names(type(p))) for p in out}
        raise TypeError(f"unknown option {unused[0]!r}: no selected pass takes it "
                        f"(options by pass: {takes or 'no passes selected'})")
    return out


def _stderr_log(msg: str) -> None:
    print(f"tidal: {msg}", file=sys.stderr, flush=True)


def compile(model: torch.nn.Module, example_inputs: Any, *,
            passes: Union[str, Sequence[PassSpec]] = (), cluster: Optional[Cluster] = None,
            loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
            optimizer: OptimizerSpec = None, example_targets: Any = None,
            leaf_modules: Iterable[LeafSpec] = (), verbose: bool = False,
            lower: Optional[str] = None, batch: str = "global", check_batch: bool = True,
            check_finite: bool = False, **options: Any) -> Compiled:
    """Trace ``model``, annotate per-node costs and run ``passes`` on the graph.

    ``example_inputs``: a tuple of inputs (a single tensor is accepted; a dict for Hugging Face
    models); dim 0 of the first tensor is the global batch. ``passes``: registered pass names,
    pass objects, or ``"auto"``. ``cluster``: the machine to plan for (default
    ``Cluster()``: the world size under torchrun, else 1 GPU). ``loss_fn(outputs, targets)`` and
    ``optimizer`` (a factory ``params -> Optimizer`` or an instance) enable ``Compiled.step``.
    ``leaf_modules`` keeps modules (paths or classes) whole when tracing. ``lower``:
    ``"graphs"`` runs the graph lowered into captured segments (``tidal.runtime.lower``),
    ``"none"`` runs it as is; default ``"graphs"`` on a CUDA model, else ``"none"``. Other keyword
    ``options`` go to every selected pass whose constructor takes them.

    ``batch`` says how the ranks pass training data (``PassContext.batch``): ``"global"``
    (default) when every rank passes the same global batch, of which each rank's program takes
    its share; ``"local"`` when each rank passes its own local batch, as a DDP loop with
    ``DistributedSampler`` does: every step then all-gathers the ranks' batches along dim 0 in
    rank order into the global batch (a last, smaller batch too), and ``example_inputs`` /
    ``example_targets`` are this rank's local batch as well (``compile`` joins them the same
    way, so the plan is for the global batch). ``check_batch`` (default True) checks the data
    every step with one small collective: under ``"global"`` that every rank's batch is the
    same (a ``BatchError`` names the input and the ranks that differ), under ``"local"`` that
    what is not split by rows (Python values, 0-dim tensors) is equal on every rank. Under
    both, a tensor input or target whose dim 0 is not the batch's is an error, never
    replicated (``tidal.runtime.batch_data.global_batch``). A step on an empty global batch (0
    rows) is a ``BatchError``. ``check_finite`` (default False, as in PyTorch): a NaN or
    infinite loss raises ``NonFiniteLossError`` naming the step, on every rank, from
    ``Compiled.step`` with the parameters, buffers and optimizer state put back (it keeps a
    copy of them each step) and from ``Compiled.backward`` before the loop's optimizer steps
    (``tidal.compiler.step_checks``).

    Example:
        >>> import torch, tidal
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8)
        >>> compiled = tidal.compile(model, (x,))
        >>> torch.equal(compiled(x), model(x))
        True
        >>> print(compiled.report().splitlines()[0].split())
        ['pass', 'ms', 'nodes', 'in', 'nodes', 'out', 'added', 'removed', 'plan']
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    check_batch_options(batch, check_batch)
    if not isinstance(check_finite, bool):
        raise TypeError(f"compile(check_finite={check_finite!r}): check_finite is True or False "
                        "(whether a non-finite loss stops the step)")
    if batch == "local":
        example_inputs, example_targets = global_batch(example_inputs, example_targets, batch,
                                                       check=check_batch)
    log = _stderr_log if verbose else (lambda msg: None)
    with tracing():     # one compile traces at a time in a process (tidal.ir.trace_lock)
        gm, records, ctx = _build(model, example_inputs, passes, options, leaf_modules, dict(
            cluster=cluster or Cluster(), model=model, loss_fn=loss_fn, optimizer=optimizer,
            example_targets=example_targets, log=log, encode_decode_s=_measurer(model),
            batch=batch, check_batch=check_batch))
        check_world(records)
        return Compiled(model, gm, records, ctx, lower=lower, check_finite=check_finite)


def _build(model: torch.nn.Module, example_inputs: Any, passes: Union[str, Sequence[PassSpec]],
           options: Mapping[str, Any], leaf_modules: Iterable[LeafSpec],
           context: Mapping[str, Any]) -> tuple[Any, list[PassRecord], PassContext]:
    """``compile``'s graph work: trace, annotate costs, select and run the passes. Returns the
    graph, the report's records and the ``PassContext`` (``context``: its fields beside the
    example inputs and batch size)."""
    records: list[PassRecord] = []
    t0 = time.perf_counter()
    gm = trace(model, example_inputs, leaf_modules=leaf_modules)
    t1 = time.perf_counter()
    records.append(PassRecord("trace", t1 - t0, 0, len(gm.graph.nodes),
                              graph_after=snapshot(gm.graph), notes=meta.get_trace_notes(gm)))
    positional = bind_inputs(gm, example_inputs, "example_inputs")
    check_input_dtypes(gm, positional)
    cost.annotate(gm, positional)
    t2 = time.perf_counter()
    n = len(gm.graph.nodes)
    records.append(PassRecord("annotate", t2 - t1, n, n, graph_after=snapshot(gm.graph),
                              notes=(_cost_note(gm, cost.example_batch(positional)),)))
    ctx = PassContext(example_inputs=positional, batch_size=cost.example_batch(positional),
                      **context)
    selected = resolve_passes(passes, options, ctx)
    if isinstance(passes, str) and passes == "auto":
        selected, skipped = auto_select(selected, gm, ctx)
        records.append(PassRecord("auto", 0.0, n, n, notes=skipped or ("selected every pass",)))
    if ctx.loss_fn is None:
        needs = [p.name for p in selected if p.training_only]
        if needs:
            raise PassError(f"pass {needs[0]!r} transforms training: give loss_fn and optimizer")
    _check_exclusive(selected)
    gm, pass_records = run_passes(gm, selected, ctx)
    return gm, records + pass_records, ctx


def check_world(records: Sequence[PassRecord]) -> None:
    """Raise ``PlanError`` naming the pass and both sizes when a plan of ``records`` is for
    another number of GPUs than the ranks of the job (``torch.distributed`` initialized), so a
    plan for 4 GPUs on 2 ranks fails at compile, not inside the first step.

    Example:
        >>> check_world([])    # no plans (or no process group): nothing to check
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    plans = CompiledPlan(tuple((r.name, r.plan) for r in records if r.plan is not None))
    why = plans.world_mismatch(dist.get_world_size())
    if why:
        raise PlanError(f"tidal.compile: {why}")


def check_batch_options(batch: Any, check_batch: Any) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``compile``'s ``batch`` or ``check_batch``
    when its value is not one it takes.

    Example:
        >>> check_batch_options("local", False)
        >>> check_batch_options("sharded", True)
        Traceback (most recent call last):
        ...
        ValueError: compile(batch='sharded'): batch is one of ('global', 'local'): ...
    """
    if batch not in BATCH_CONVENTIONS:
        raise ValueError(f"compile(batch={batch!r}): batch is one of {BATCH_CONVENTIONS}: "
                         "'global' when every rank passes the same global batch, 'local' when "
                         "each rank passes its own (DistributedSampler)")
    if not isinstance(check_batch, bool):
        raise TypeError(f"compile(check_batch={check_batch!r}): check_batch is True or False "
                        "(whether every step checks the ranks' batches)")


def _measurer(model: torch.nn.Module) -> Callable[..., float]:
    """``PassContext.encode_decode_s``: a compressor timed on this machine, on the device of
    the model's parameters."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return functools.partial(encode_decode_s, device=device)


def auto_select(passes: Sequence[Pass], gm, ctx: PassContext
                ) -> tuple[list[Pass], tuple[str, ...]]:
    """What ``passes="auto"`` runs: the passes that keep the training step what it is and
    apply to this model and cluster, the first of each ``exclusive`` group. Returns them and
    one note per skipped pass saying why (a pass that changes the update is used only when
    named)."""
    kept: list[Pass] = []
    notes: list[str] = []
    chosen: dict[str, str] = {}
    for p in passes:
        if p.training_only and ctx.loss_fn is None:
            why = "it transforms training: give loss_fn and optimizer"
        elif p.changes_update:
            why = f"{p.changes_update}; name it in passes= to use it"
        elif p.exclusive and p.exclusive in chosen:
            why = f"{chosen[p.exclusive]!r} was selected instead ({p.exclusive})"
        else:
            why = p.why_not(gm, ctx) or _overridden_applies_says_no(p, gm, ctx)
        if not why:
            kept.append(p)
            chosen.setdefault(p.exclusive, p.name)
            continue
        notes.append(f"skipped {p.name}: {why}")
    return kept, tuple(notes)


def _overridden_applies_says_no(p: Pass, gm, ctx: PassContext) -> str:
    """A generic reason when a pass overrides ``applies`` (not ``why_not``) and it says no."""
    if type(p).applies is Pass.applies or p.applies(gm, ctx):
        return ""
    return f"it does not apply to this model on {ctx.cluster.gpus} GPU(s) at batch {ctx.batch_size}"


def _check_exclusive(passes: Sequence[Pass]) -> None:
    """Raise ``PassError`` when two selected passes are alternatives to each other."""
    by_tag: dict[str, str] = {}
    for p in passes:
        if p.exclusive and p.exclusive in by_tag:
            raise PassError(f"passes {by_tag[p.exclusive]!r} and {p.name!r} are alternatives "
                            f"({p.exclusive}); select one of them")
        if p.exclusive:
            by_tag[p.exclusive] = p.name


def _cost_note(gm, batch: int) -> str:
    t = cost.total_cost(gm, batch)
    return (f"batch {batch}: {t['fwd_flops'] / 1e9:.3g} GFLOP forward, "
            f"{t['bwd_flops'] / 1e9:.3g} GFLOP backward, "
            f"{t['param_bytes'] / 2**20:.3g} MiB parameters")
