"""``Compiled``: what ``tidal.compile`` returns — a runnable model plus what each pass did."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_map

from tidal.compiler.guards import CaptureGuard, StepGuardError
from tidal.compiler.module_face import ModuleFace
from tidal.compiler.pass_manager import PassRecord
from tidal.compiler.step_checks import StateSnapshot, check_loss, check_rows
from tidal.ir.collectives import new_group
from tidal.ir.inputs import bind_inputs
from tidal.ir.table import format_table
from tidal.ir.pass_api import Executor, PassContext
from tidal.ir.plan import CompiledPlan
from tidal.ir.step_state import step_state
from tidal.runtime import executors
from tidal.runtime.batch_data import BatchCheck, batch_check, global_batch
from tidal.runtime.program import chrome_trace, device_of
from tidal.runtime.programs.step_failures import collective_errors
from tidal.runtime.programs.graph import GraphProgram, lowered_graph

OptimizerSpec = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer], None]


class Compiled(ModuleFace):
    """A compiled model. Call it like the model; ``step`` trains it; ``plan``, ``report()`` and
    ``dump(dir)`` show what the passes did.

    Example:
        >>> import torch, tidal
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> c = tidal.compile(model, (torch.randn(3, 4),), loss_fn=torch.nn.functional.cross_entropy,
        ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> loss = c.step((torch.randn(3, 4),), torch.tensor([0, 1, 1]))
        >>> loss.dim()
        0
    """

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule, records: Sequence[PassRecord],
                 ctx: PassContext, lower: Optional[str] = None, check_finite: bool = False):
        self.model = model
        self.check_finite = check_finite
        """Whether a non-finite loss stops ``step``/``backward`` (``compiler.step_checks``)."""
        self.graph_module = gm
        self.records = tuple(records)
        self.context = ctx
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._plans = [r.plan for r in self.records if r.plan is not None]
        self.executor: Executor = executors.build(
            gm, self._plans, lowered_graph(gm, ctx.example_inputs, lower))
        """The one executor every call, step and job runs through (a ``ProgramExecutor``:
        the rank program of the plans, or the graph as it is)."""
        rank_program = self.executor.rank_program
        self.guard = CaptureGuard(model, gm, ctx.example_inputs,
                                  tuple(r.name for r in self.records if r.plan is not None),
                                  program=None if isinstance(rank_program, GraphProgram)
                                  else rank_program,
                                  traced=self.records[0].graph_after,
                                  refresh=getattr(rank_program, "refresh_state", None),
                                  loss_fn=ctx.loss_fn, recapture=self._recapture)
        """What runs when the state a capture depends on changed (``compiler.guards``)."""
        self.train_trace: list = []
        """The scheduler's records of every piece the latest ``train`` ran (every job's)."""
        self._generation: Optional[torch.nn.Module] = None
        self._no_sync = False
        self._batch_pg: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the compiled forward (as the executor's rank program runs it). In another
        training mode than the compile's, the model traced in that mode runs
        (``tidal.compiler.guards``)."""
        graph = self.guard.forward_graph(self.lowered is not None)
        if graph is not None:
            return graph(*args, **kwargs)
        local = getattr(self.executor.rank_program, "forward_local", None)
        if self.context.batch == "local" and local is not None:   # this rank's rows back
            return local(self.graph_module, args, kwargs, group=self._batch_group(),
                         check=self.context.check_batch)
        return self.executor.forward(self.graph_module, *args, **kwargs)

    @property
    def calls(self) -> int:
        """How many ``step``/``backward`` calls the executor ran (the step number that
        ``NonFiniteLossError`` and ``StepMismatchError`` name)."""
        return self.executor.calls

    @property
    def lowered(self) -> Optional[torch.nn.Module]:
        """The graph's lowered form (``compile(lower="graphs")``) when the graph runs as it
        is, else None."""
        return getattr(getattr(self.executor, "rank_program", None), "lowered", None)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face ``generate`` with the ``clustered_attention`` plan (CHAI) run in the
        model's own attention modules and KV cache: after each sequence's first five tokens,
        scores only for its representative heads, K kept only for the KV heads they read
        (``tidal.runtime.chai.generate``). Arguments are ``generate``'s; ``past_key_values``,
        if given, must come from :meth:`new_cache`. Greedy and sampling, batches (left-padded
        when lengths differ).

        Example:
            >>> import torch, transformers, tidal
            >>> from tidal.passes.clustered_attention import ClusteredAttention
            >>> cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
            ...                               n_positions=64)
            >>> model = transformers.GPT2LMHeadModel(cfg).eval()
            >>> ids = torch.randint(1, 64, (2, 9))   # no token equals pad_token_id 0
            >>> c = tidal.compile(model, (ids,), passes=[ClusteredAttention(2)])
            >>> cache = c.new_cache()
            >>> c.generate(ids, max_new_tokens=4, do_sample=True, past_key_values=cache,
            ...            pad_token_id=0).shape
            torch.Size([2, 13])
            >>> cache.k_cache_bytes() * 2 == cache.v_cache_bytes()   # K of 2 heads of 4
            True
        """
        return self.generation_model().generate(*args, **kwargs)

    def new_cache(self) -> Any:
        """An empty ``ClusteredKCache`` for :meth:`generate` (``past_key_values=``)."""
        return self.generation_model().new_cache()

    def generation_model(self) -> torch.nn.Module:
        """The Hugging Face model with its attention clustered by the ``clustered_attention``
        plan (a copy sharing the model's parameters; built once). ``ValueError`` without
        that plan."""
        if self._generation is None:
            from tidal.passes.clustered_attention import PASS_NAME as CHAI_PASS
            from tidal.runtime.chai.generate import generation_model

            plan = self.plan.get(CHAI_PASS)
            ran = [r for r in self.records if r.name == CHAI_PASS]
            if plan is None and ran:
                raise ValueError(f"Compiled.generate runs the {CHAI_PASS} plan, and the pass "
                                 f"found nothing to cluster in {type(self.model).__name__}: "
                                 f"{'; '.join(ran[0].notes) or 'no notes'}")
            if plan is None:
                raise ValueError(f"Compiled.generate runs the {CHAI_PASS} plan, and this model "
                                 f"was compiled without one (passes: "
                                 f"{', '.join(r.name for r in self.records) or 'none'}); call "
                                 f"the model's own generate, or compile with "
                                 f"ClusteredAttention(clusters=...) or a calibrated plan")
            self._generation = generation_model(self.model, plan)
        return self._generation

    @property
    def plan(self) -> CompiledPlan:
        """Every plan the passes chose, by pass name, in run order (JSON round-trippable)."""
        return CompiledPlan(tuple((r.name, r.plan) for r in self.records if r.plan is not None))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the model's parameters (built on first use from the factory)."""
        if self._optimizer is None:
            spec = self.context.optimizer
            if spec is None:
                raise ValueError("Compiled.step needs an optimizer: tidal.compile(..., "
                                 "optimizer=lambda params: torch.optim.SGD(params, lr=0.1))")
            self._optimizer = spec if isinstance(spec, torch.optim.Optimizer) else spec(
                self.model.parameters())
            if not isinstance(self._optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer factory returned {type(self._optimizer).__name__}, "
                                "not a torch.optim.Optimizer")
        return self._optimizer

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """One training step on the global batch: forward, ``loss_fn(outputs, targets)``,
        backward and the optimizer step, updating the model's parameters in place. ``inputs``
        is a tensor, a tuple of positional inputs or a dict of keyword inputs (bound to the
        model's forward parameters by name). Returns the loss (detached)."""
        if self.context.loss_fn is None:
            raise ValueError("Compiled.step needs a loss: tidal.compile(..., loss_fn=fn) with "
                             "fn(outputs, targets) -> scalar tensor")
        inputs, targets, check = self._global_batch(inputs, targets, "Compiled.step inputs",
                                                    defer=True)
        check_rows(inputs, targets, "Compiled.step")
        kept = StateSnapshot(self.model, self.optimizer, self) if self.check_finite else None
        loss = self.executor.step(self._step_graph(), self.model, inputs, targets,
                                  self.context.loss_fn, self.optimizer, batch_check=check)
        if kept is not None and not bool(torch.isfinite(loss).all()):
            left = kept.restore()
            check_loss(loss, self.calls, "Compiled.step", "the parameters, buffers and "
                       "optimizer state are put back as they were before it" +
                       (f", {left}" if left else ""))
        return loss

    def _global_batch(self, inputs: Any, targets: Any, what: str, defer: bool = False
                      ) -> tuple[tuple, Any, Optional[BatchCheck]]:
        """The step's global batch from what this rank passed (``compile(batch=...)``:
        ``tidal.runtime.batch_data.global_batch``), its inputs bound to the graph's
        placeholders, and its deferred check. With ``defer`` (a step the executor numbers),
        under ``batch="global"`` with ``check_batch`` on several ranks, the ranks' batches are
        not exchanged here: the ``BatchCheck`` returned rides on the step's loss all-reduce
        (``tidal.runtime.batch_data.batch_check``), no round of its own; else it is None."""
        inputs = bind_inputs(self.graph_module, inputs, what)
        if defer and self.context.batch == "global" and self.context.check_batch:
            return inputs, targets, batch_check(inputs, targets, group=self._batch_group())
        with collective_errors(what.split(" ")[0], f"the exchange of the ranks' batches "
                               f"(compile(batch={self.context.batch!r}))"):
            return *global_batch(inputs, targets, self.context.batch,
                                 check=self.context.check_batch,
                                 group=self._batch_group()), None

    def _batch_group(self) -> Any:
        """The process group of the batch exchange, a group of its own (made on first use;
        every rank binds its steps in the same order): a scheduler job binds step ``i + 1``
        while step ``i``'s collectives run on the default group, and two threads must never
        issue collectives on one group. None in one process."""
        if self._batch_pg is None and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            self._batch_pg = new_group()
        return self._batch_pg

    def _step_graph(self, where: str = "Compiled.step") -> torch.fx.GraphModule:
        """The graph this step runs (the compiled one, or one the guard gives)."""
        graph = self.guard.step_graph(self.lowered is not None, where)
        return self.graph_module if graph is None else graph

    def _recapture(self, old: Any, kept: Optional[Any], where: str) -> Any:
        """The rank program for a new step state (``compiler.guards``: freezing, unfreezing,
        ``model.eval()``; ``old`` None: no program, the graph runs with autograd): ``kept``
        (that state's program from before) or one built again from
        the plans (a program whose ``recaptures_state`` is true keys its captures by the state
        itself and stays), with what ``old`` held beside the model and the optimizer
        (``runtime_state``) carried over, installed in the executor. A closed step
        (``Compiled.step``) owns zeroing the gradients, as ``optimizer.zero_grad()`` before
        eager backward: a parameter frozen now loses its ``.grad`` (its optimizer skips it).
        Raises ``StepGuardError`` when the trainable set changed and ``old`` keeps state by
        parameter position (its ``runtime_state_by_name`` is not true)."""
        carried = getattr(old, "runtime_state", None)
        state = {} if carried is None or getattr(old, "recaptures_state", False) else \
            carried(self.graph_module)
        if state and not getattr(old, "runtime_state_by_name", False) and \
                self.guard.current.requires_grad != step_state(self.model).requires_grad:
            raise StepGuardError(
                f"{where}: requires_grad changed after the first step, and the program of "
                f"{', '.join(self.guard.plans)} ({type(old).__name__}) keeps state by the "
                f"position of each trainable parameter (e.g. tick_tock's tock gradient for "
                f"Eq. 1): it cannot carry it to another set of trainable parameters yet; "
                f"freeze before the first step, or compile the model again")
        if where != "Compiled.backward":
            for p in self.model.parameters():
                if not p.requires_grad:
                    p.grad = None
        if old is None or getattr(old, "recaptures_state", False):
            return old   # no program (autograd follows the state), or one that re-captures
        new = kept if kept is not None else executors.build(self.graph_module,
                                                            self._plans).rank_program
        if state:
            new.load_runtime_state(self.graph_module, self.optimizer if
                                   self.context.optimizer is not None else None, state)
        elif carried is None and any(r.name == "compression" for r in self.records):
            print(f"tidal: {', '.join(self.guard.plans)}: the compressor state (error "
                  f"feedback) starts afresh in the re-captured step: "
                  f"{type(old).__name__} keeps no runtime state", file=sys.stderr)
        self.executor.rank_program = new
        return new

    def backward(self, inputs: Any, targets: Any, *, scale: Any = None) -> torch.Tensor:
        """The open step, as DDP's: forward, ``loss_fn(outputs, targets)`` and backward of one
        (micro-)batch, with the gradients synchronized over the ranks and *added* to each
        trainable parameter's ``.grad`` (as ``loss.backward()`` adds them); the loop then does
        what it wants before its own optimizer's step (clip with :meth:`clip_grad_norm_`,
        ``GradScaler.unscale_``/``step``, several optimizers, schedulers) and zeroes the
        gradients itself. ``scale`` multiplies the loss before backward (``1 / k`` for
        accumulation over ``k`` micro-batches; a ``torch.amp.GradScaler``: its scale, then
        ``scaler.unscale_(opt)``, ``scaler.step(opt)``, ``scaler.update()`` as usual). Inside
        :meth:`no_sync`, gradients accumulate locally and the next call outside it syncs
        their sum (DDP's ``no_sync``). Returns the (unscaled) loss of the global batch.

        Example:
            >>> import torch, tidal
            >>> model = torch.nn.Linear(4, 2)
            >>> c = tidal.compile(model, (torch.randn(8, 4),),
            ...                   loss_fn=torch.nn.functional.cross_entropy)
            >>> opt = torch.optim.AdamW(c.parameters(), lr=1e-3)
            >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            >>> loss = c.backward(x, y)
            >>> norm = c.clip_grad_norm_(1.0)
            >>> opt.step(); opt.zero_grad()
        """
        if self.context.loss_fn is None:
            raise ValueError("Compiled.backward needs a loss: tidal.compile(..., loss_fn=fn) "
                             "with fn(outputs, targets) -> scalar tensor")
        inputs, targets, check = self._global_batch(inputs, targets,
                                                    "Compiled.backward inputs", defer=True)
        check_rows(inputs, targets, "Compiled.backward")
        if isinstance(scale, torch.amp.GradScaler):   # its scale, as scaler.scale(loss) reads it
            scale = scale.scale(torch.ones((), device=device_of(self.model)))
        loss = self.executor.backward(self._step_graph("Compiled.backward"), self.model,
                                      inputs, targets, self.context.loss_fn, scale=scale,
                                      sync=not self._no_sync, batch_check=check)
        if self.check_finite:
            check_loss(loss, self.calls, "Compiled.backward", "no optimizer has stepped, but "
                       "its gradients were added to .grad: zero them before the next step")
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, :meth:`backward` accumulates gradients locally without synchronizing them;
        the first call after it syncs the sum (DDP's ``no_sync``, for accumulation)."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter by their global norm (over every rank, each
        parameter counted once), as ``torch.nn.utils.clip_grad_norm_`` does on one process;
        returns the total norm before clipping."""
        return self.executor.clip_grad_norm_(self.model, max_norm, norm_type)

    def job(self, batches: Callable[[int], tuple[Any, Any]], *, name: str = "train",
            iterations: Optional[int] = None) -> Any:
        """Training as a job for ``tidal.runtime.scheduler.Runtime``: iteration ``i`` trains
        on ``batches(i)`` (``(inputs, targets)``, as ``step`` takes them); its losses collect
        in ``job.losses``. Submit it as the foreground or as a background job beside another
        model's::

            rt = Runtime("cpu")
            rt.submit(fg.job(batches, iterations=10), priority="high")
            rt.submit(bg.job(other_batches, name="extra"), priority="low")
            rt.run()

        With plans, the job's pieces are the rank's program (compute, communication and
        optimizer pieces on their streams); without, each iteration is two pieces:
        ``forward`` (with the loss) and ``backward`` (with the optimizer's step,
        ``tidal.runtime.programs.graph``)."""
        if self.context.loss_fn is None:
            raise ValueError("Compiled.job needs a loss: tidal.compile(..., loss_fn=fn)")
        # no collective on the scheduler's binding thread, which binds the iterations of its
        # jobs in an order that differs from rank to rank: the batch exchange's group is made
        # here (in the caller's order, the same on every rank) and, under batch="global", the
        # check rides on the step's loss all-reduce (``defer``), as in ``step``
        self._batch_group()

        def bound(i: int) -> tuple[Any, Any, Optional[BatchCheck]]:
            inputs, targets = batches(i)
            return self._global_batch(inputs, targets, "Compiled.job inputs", defer=True)

        return self.executor.job(name, self._step_graph(), self.model, bound,
                                 self.context.loss_fn, self.optimizer, iterations)

    def train_scheduled(self, batches: Callable[[int], tuple[Any, Any]], iterations: int, *,
                        background: Any = None, idle_only: bool = True) -> dict[str, Any]:
        """Train ``iterations`` steps on ``batches(i)`` as the foreground job of a scheduler
        on this process's device, with ``background`` (a job: another model's
        ``compiled.job(...)``) packed into the foreground's idle spans (``idle_only``, DeepPool's
        BP+Col; False: the slowdown-feedback policy). Returns the per-job statistics
        (``tidal.runtime.scheduler.JobStats``: iterations, throughput, slowdowns); the
        foreground's losses are in ``stats[...]`` and in the job (``job.losses``); every
        piece's times are in ``train_trace`` (``tidal.sim.collocation.job_idle_spans`` reads
        the foreground's idle spans from it, to size a background job).

        Example:
            >>> import torch, tidal
            >>> fg = tidal.compile(torch.nn.Linear(4, 2), (torch.randn(8, 4),),
            ...                    loss_fn=torch.nn.functional.cross_entropy,
            ...                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
            >>> bg = tidal.compile(torch.nn.Linear(4, 2), (torch.randn(8, 4),),
            ...                    loss_fn=torch.nn.functional.cross_entropy,
            ...                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
            >>> batch = lambda i: (torch.randn(8, 4), torch.randint(0, 2, (8,)))
            >>> stats = fg.train_scheduled(batch, 3, background=bg.job(batch, name="extra"))
            >>> stats["train"].iterations
            3
        """
        from tidal.runtime.backend import backend_for
        from tidal.runtime.scheduler import Runtime

        params = list(self.model.parameters())
        device = params[0].device if params else torch.device("cpu")
        # the CPU stands in for one device: with a background job it runs one piece at a time
        # (the gate gives it to the foreground first); alone, its streams run side by side
        options = {"slots": 1 if background is not None else None} \
            if device.type == "cpu" else {}
        # idle_only: two background pieces may queue on their stream (no dispatch between
        # them); the device still goes to the foreground first when it needs it
        with Runtime(backend=backend_for(device, **options), idle_only=idle_only,
                     be_depth=2 if idle_only else 1) as runtime:
            runtime.submit(self.job(batches, iterations=iterations), priority="high")
            if background is not None:
                runtime.submit(background, priority="low")
            stats = runtime.run()
            self.train_trace = list(runtime.trace)
            return stats

    def bagpipe(self, data: Any, iterations: int, **options: Any) -> Any:
        """Train with Bagpipe (the ``embedding_cache`` plan, dissertation ch. 5): the rewritten
        graph on ``trainers`` trainer processes, the model's embedding tables on row-sharded
        embedding servers, the Oracle Cacher looking ``lookahead`` batches ahead of ``data``
        (``.batch(i) -> (inputs, targets)`` or such a callable) to prefetch and to cache with a
        TTL; LRPP caches and delayed synchronization; synchronous SGD semantics (bit for bit).
        ``options`` are :func:`tidal.runtime.bagpipe.train`'s (``trainers``, ``servers``,
        ``lookahead`` (default: the plan's), ``policy``, ``lr``, ``checkpoint_every``, ...);
        ``loss_fn`` defaults to the one given to ``compile``. Returns its ``Result``: final
        tables, dense state and per-iteration statistics. Workers are spawned: run it under
        ``if __name__ == "__main__":``.

        Example:
            >>> import tidal
            >>> from examples.models.recsys import SMALL_ROWS, click_loss, dlrm_small
            >>> from examples.data.clicks import ClickData
            >>> from tidal.passes.embedding_cache import EmbeddingCache
            >>> model, data = dlrm_small(), ClickData(4, SMALL_ROWS, 16)
            >>> c = tidal.compile(model, data.batch(0)[0], loss_fn=click_loss,
            ...                   passes=[EmbeddingCache(lookahead=5)])
            >>> result = c.bagpipe(data, 20, trainers=2)     # doctest: +SKIP
            >>> sum(s.hits for s in result.stats) > 0          # doctest: +SKIP
            True
        """
        from tidal.runtime.bagpipe import train

        plan = self.plan.get("embedding_cache")
        if plan is None:
            raise ValueError("Compiled.bagpipe: no embedding_cache plan: compile with "
                             "passes=[EmbeddingCache(...)] on a model with embedding lookups")
        weights = {t.name: _table_weight(self.model, t.name) for t in plan.tables}
        options.setdefault("lookahead", plan.lookahead)
        if options.get("loss_fn") is None:
            options["loss_fn"] = self.context.loss_fn
        return train((self.graph_module, plan, weights), data, iterations, **options)

    def trace(self, path: Union[str, Path]) -> Path:
        """Write the pieces of the latest ``step`` (per stream, this rank as the process) as a
        Chrome trace (``chrome://tracing``, ui.perfetto.dev); returns the path. Raises
        ``ValueError`` when the plans run through an executor that records no pieces yet, or
        before the first step."""
        pieces = self.executor.last_trace
        if not pieces:
            raise ValueError("Compiled.trace: no pieces recorded: no step has run yet")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        out = Path(path)
        out.write_text(json.dumps(chrome_trace({rank: pieces})))
        return out

    def cold_start(self, path: Union[str, Path], *inputs: Any, device: Any = None,
                   **kwargs: Any) -> Any:
        """The first output while the weights stream in, group by group, from the store at
        ``path`` (written by ``tidal.runtime.weights.loader.write_groups``; needs the
        ``layer_groups`` pass) onto ``device`` (by default where the model's parameters are;
        the inputs' tensors are moved there). Inputs default to the compile-time example
        inputs."""
        plan = self.plan.get("layer_groups")
        if plan is None:
            raise ValueError(f"Compiled.cold_start streams the weights group by group: compile "
                             f"with passes=[LayerGroups()] first (passes run: "
                             f"{', '.join(r.name for r in self.records) or 'none'})")
        gm = self.graph_module
        where = torch.device(device) if device is not None else device_of(gm)
        if not inputs and not kwargs:
            example = self.context.example_inputs
            inputs, kwargs = ((), dict(example)) if isinstance(example, Mapping) else \
                (tuple(example), {})
        inputs, kwargs = tree_map(lambda v: v.to(where) if isinstance(v, torch.Tensor) else v,
                                  (tuple(inputs), dict(kwargs)))
        return executors.weight_streaming(gm, plan, path, where).forward(gm, *inputs, **kwargs)

    def report(self) -> str:
        """A table of the compile stages and passes: wall time, node counts, what was added
        and removed, and each plan's summary, followed by the passes' notes and, after a
        step, what the runtime ran uncaptured (the node and why)."""
        rows = []
        for r in self.records:
            rows.append([r.name, round(r.seconds * 1e3, 1), r.nodes_before, r.nodes_after,
                         len(r.added), len(r.removed), r.plan.summary() if r.plan else "-"])
        text = format_table(["pass", "ms", "nodes in", "nodes out", "added", "removed", "plan"],
                            rows)
        notes = [f"  {r.name}: {n}" for r in self.records for n in r.notes]
        notes += [f"  runtime: {n}" for n in self.executor.notes()]  # known after a step
        return text + ("\nnotes:\n" + "\n".join(notes) if notes else "")

    def dump(self, out_dir: Union[str, Path], *, scaling: Any = None,
             sections: Optional[Callable[[Path], Sequence[Any]]] = None) -> Path:
        """Write each pass's graph before/after (DOT, and SVG when graphviz is installed), the
        passes' artifacts and an ``index.html`` listing them in order; return the index path.
        With ``scaling`` (a statistical-efficiency table: a ``global_batch,steps`` CSV path or a
        ``tidal.runtime.sim.scaling.StepsTable``), the index also shows the simulated weak,
        strong and batch-optimal scaling of the model on the compile's cluster (DeepPool
        Fig. 1) as ``scaling.svg`` and ``scaling.txt``. ``sections`` (a function of the
        directory that writes its files there and returns more index sections,
        ``viz.DumpSection``) adds them at the end of the index."""
        from tidal.compiler.dump import scaling_section, write_dump

        title = type(self.model).__name__
        extra = []
        if scaling is not None:
            extra.append(scaling_section(Path(out_dir), self.graph_module, self.context.cluster,
                                         self.context.batch_size, scaling, title))
        if sections is not None:
            extra.extend(sections(Path(out_dir)))
        return write_dump(Path(out_dir), title, self.records, self.context.batch_size, extra)


def _table_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The full table of the cached embedding ``name``: the weight of the module at that path,
    or the parameter at that path (an ``F.embedding`` table)."""
    try:
        return model.get_submodule(name).weight.detach()
    except AttributeError:
        return model.get_parameter(name).detach()
