"""Lowering: an fx graph into captured static segments, optionally split into bounded pieces.

``lower(gm, example_inputs)`` walks the graph in order and cuts it into steps:

- **captured** runs of nodes with static shapes and no host synchronisation. Each run may be
  split into pieces whose predicted duration (``tidal.ir.cost.node_time_us``) stays under
  ``piece_us`` (DeepPool splits background graphs at ``be_graph_split_ms = 0.5``, i.e. 500 µs);
- **boundary** steps: one tidal custom op or collective each (``torch.distributed`` calls,
  ``c10d`` ops), run uncaptured so the runtime can treat them as their own operators;
- **eager** steps: a host sync (``.item()``, ``.tolist()``, ``bool(t)``...), an op with a
  data-dependent output shape (``nonzero``, ``masked_select``, boolean indexing...), anything
  using such a value, an in-place update of a graph input, or a call of a module that says
  why it cannot be captured (its ``uncaptured_reason``: CHAI's clustered attention). The report
  names the node that stopped the preceding segment and why. A step whose capture fails all the
  same (``CaptureError``: a host sync the rules above missed) runs uncaptured from then on,
  with a warning and ``capture failed: ...`` as its reason in the report.

Every step is compiled once into a straight-line Python function (module calls bound to their
``forward``, or to ``F.linear``/``F.conv2d`` with the weights bound, when the module has no hooks;
values freed after their last use), then captured by the backend per input signature (CUDA: a
CUDA graph; CPU: the program bound to static input slots). ``LoweredModule.forward`` equals
the graph's forward; ``LoweredModule.pieces(...)`` returns the steps as schedulable pieces.

Example:
    >>> import torch, tidal
    >>> from tidal.runtime.lower import lower
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4)
    >>> lowered = lower(tidal.trace(model, (x,)), (x,))
    >>> torch.equal(lowered(x), model(x))
    True
    >>> [s.kind for s in lowered.report.steps]
    ['captured']
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import math
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from tidal.ir.inputs import bind_inputs
from tidal.ir.table import format_table
from tidal.ir import meta
from tidal.ir.cluster import Cluster
from tidal.ir.node_runner import COMPUTE_OPS, fetch_attr, written_nodes
from tidal.ir.ops import is_tidal_op
from tidal.ir.program import COLLECTIVE, COMPUTE, SEGMENT, Piece
from tidal.runtime.backend import Backend, CaptureError, backend_for
from tidal.runtime.scheduling.pieces import BoundPiece

_HOST_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__",
                                "__index__"})
_DYNAMIC_NAMES = frozenset({"nonzero", "masked_select", "unique", "unique_consecutive",
                            "argwhere", "_unique", "_unique2", "unique_dim",
                            "_local_scalar_dense", "item"})
_HOST_SYNC_BUILTINS = (builtins.bool, builtins.int, builtins.float, builtins.print)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "c10d_functional", "_c10d_functional",
                                    "_c10d_functional_autograd"})
_INFIX = {operator.getitem: "{}[{}]", operator.add: "{} + {}", operator.sub: "{} - {}",
          operator.mul: "{} * {}", operator.truediv: "{} / {}", operator.floordiv: "{} // {}",
          operator.matmul: "{} @ {}"}


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0]
    return getattr(target, "__name__", str(target))


def _is_collective(target: Any) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace in _COLLECTIVE_NAMESPACES or is_tidal_op(target)
    return callable(target) and getattr(target, "__module__", "").startswith("torch.distributed")


def _is_bool_tensor(arg: Any) -> bool:
    if isinstance(arg, fx.Node):
        return any(t.dtype == torch.bool for t in meta.get_tensors(arg))
    if isinstance(arg, (tuple, list)):
        return any(_is_bool_tensor(a) for a in arg)
    return False


def _written_input(gm: fx.GraphModule, n: fx.Node) -> Optional[fx.Node]:
    """The first graph input or buffer ``n`` writes in place, if any (see
    :func:`_written_inputs`)."""
    written = _written_inputs(gm, n)
    return written[0] if written else None


def _written_inputs(gm: fx.GraphModule, n: fx.Node) -> list[fx.Node]:
    """The graph inputs (placeholders) and attributes (``get_attr``: a buffer) ``n`` writes in
    place, through views and chains of in-place ops
    (:func:`tidal.ir.node_runner.written_nodes`)."""
    return [w for w in written_nodes(gm, n) if w.op in ("placeholder", "get_attr")]


def _written_name(n: fx.Node) -> str:
    return f"graph input {n.name}" if n.op == "placeholder" else f"buffer {n.target}"


def stop_reason(gm: fx.GraphModule, n: fx.Node) -> Optional[tuple[str, str]]:
    """Why compute node ``n`` cannot be inside a captured segment, as ``(kind, reason)`` with
    kind ``"boundary"`` (collective / tidal op) or ``"eager"``; None if it can be captured."""
    target = n.target
    if n.op in ("call_function", "call_method") and _is_collective(target):
        return "boundary", f"collective/tidal op {_target_name(target)}"
    if n.op == "call_method" and target in _HOST_SYNC_METHODS:
        return "eager", f"host sync .{target}()"
    if n.op == "call_function" and target in _HOST_SYNC_BUILTINS and any(
            isinstance(a, fx.Node) for a in n.args):
        return "eager", f"host sync {target.__name__}(tensor)"
    name = _target_name(target)
    if n.op in ("call_function", "call_method") and name in _DYNAMIC_NAMES:
        return "eager", f"data-dependent output shape ({name})"
    if n.op in ("call_function", "call_method") and name == "where" and len(n.args) + len(
            n.kwargs) == (1 if n.op == "call_function" else 0):
        return "eager", "data-dependent output shape (where(cond))"
    if target is operator.getitem and len(n.args) > 1 and _is_bool_tensor(n.args[1]):
        return "eager", "data-dependent output shape (boolean-mask indexing)"
    written = _written_input(gm, n)
    if written is not None:
        return "eager", f"in-place update of {_written_name(written)}"
    declared = _declared_uncaptured(gm, n)
    if declared is not None:
        return "eager", declared
    return None


def _declared_uncaptured(gm: fx.GraphModule, n: fx.Node) -> Optional[str]:
    """The reason a called module gives for running uncaptured (its ``uncaptured_reason``),
    if it gives one. Its output is an ordinary tensor: later nodes can still be captured."""
    if n.op != "call_module":
        return None
    mod = gm.get_submodule(n.target)
    why = getattr(mod, "uncaptured_reason", None)
    return f"{type(mod).__name__}: {why}" if why else None


@dataclass(frozen=True)
class StepInfo:
    """One lowered step: ``kind`` captured / boundary / eager, its nodes, the captured
    ``segment`` it belongs to (-1 otherwise), predicted forward µs, and for uncaptured steps
    the ``reason``."""

    index: int
    kind: str
    nodes: tuple[str, ...]
    segment: int
    predicted_us: float
    reason: str = ""


@dataclass(frozen=True)
class LowerReport:
    """What the lowering did: the steps in order and the nodes that stopped a segment."""

    steps: tuple[StepInfo, ...]
    piece_us: Optional[float]

    @property
    def stops(self) -> tuple[tuple[str, str], ...]:
        """(node, reason) of every node left uncaptured."""
        return tuple((s.nodes[0], s.reason) for s in self.steps if s.kind != "captured")

    def summary(self) -> str:
        """One line: segments, pieces, uncaptured nodes."""
        segs = {s.segment for s in self.steps if s.kind == "captured"}
        cap = sum(1 for s in self.steps if s.kind == "captured")
        return (f"{len(segs)} captured segment(s) in {cap} piece(s), "
                f"{len(self.steps) - cap} uncaptured step(s)")

    def table(self) -> str:
        """Per-step table: kind, segment, node count, first and last node, predicted µs, why."""
        rows = [[s.index, s.kind, s.segment, len(s.nodes), s.nodes[0], s.nodes[-1],
                 round(s.predicted_us, 1), s.reason or "-"] for s in self.steps]
        return format_table(["step", "kind", "segment", "nodes", "first", "last", "pred us",
                             "stopped by"], rows)


def _fast_module_call(mod: torch.nn.Module) -> Callable:
    """A callable equal to ``mod(...)`` without ``Module.__call__``'s dispatch when the module
    (and the process) has no hooks; ``mod`` itself otherwise."""
    import torch.nn.modules.module as module_mod

    hooks = [getattr(mod, a, None) for a in ("_forward_hooks", "_forward_pre_hooks",
                                             "_backward_hooks", "_backward_pre_hooks")]
    hooks += [getattr(module_mod, a, None) for a in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks")]
    if any(hooks):
        return mod
    if type(mod) is torch.nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    if type(mod) is torch.nn.Conv2d and mod.padding_mode == "zeros":
        w, b = mod.weight, mod.bias
        s, p, d, g = mod.stride, mod.padding, mod.dilation, mod.groups
        return lambda x: F.conv2d(x, w, b, s, p, d, g)
    return mod.forward


class _Codegen:
    """Renders fx arguments and nodes as Python source over a shared globals dict."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.globals: dict[str, Any] = {"slice": slice, "torch": torch}

    def const(self, value: Any) -> str:
        name = f"_c{len(self.globals)}"
        self.globals[name] = value
        return name

    @staticmethod
    def var(n: fx.Node) -> str:
        return f"v_{n.name}"

    def src(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            if a.op == "get_attr":
                return self.const(fetch_attr(self.gm, a.target))
            return self.var(a)
        if isinstance(a, tuple) and type(a) is tuple:
            return "(" + "".join(self.src(x) + ", " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(self.src(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.src(k)}: {self.src(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.src(a.start)}, {self.src(a.stop)}, {self.src(a.step)})"
        if a is None or isinstance(a, (bool, int, str)) or (
                isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        return self.const(a)

    def node_line(self, n: fx.Node) -> str:
        args = [self.src(a) for a in n.args]
        args += [f"{k}={self.src(v)}" for k, v in n.kwargs.items()]
        if n.op == "call_method":
            call = f"{args[0]}.{n.target}({', '.join(args[1:])})"
        elif n.op == "call_module":
            call = f"{self.const(_fast_module_call(self.gm.get_submodule(n.target)))}(" \
                   f"{', '.join(args)})"
        elif n.target in _INFIX and not n.kwargs and len(args) == 2:
            call = "(" + _INFIX[n.target].format(*args) + ")"
        else:
            call = f"{self.const(n.target)}({', '.join(args)})"
        return f"{self.var(n)} = {call}"

    def function(self, name: str, params: Sequence[str], body: Sequence[str]) -> Callable:
        src = f"def {name}({', '.join(params)}):\n" + "".join(
            f"    {line}\n" for line in body or ["pass"])
        scope: dict[str, Any] = {}
        exec(compile(src, f"<tidal.lower {name}>", "exec"), self.globals, scope)
        fn = scope[name]
        fn.__tidal_source__ = src
        return fn


def _value_nodes(a: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(a, lambda n: out.append(n))
    return [n for n in out if n.op != "get_attr"]


@dataclass
class _Step:
    info: StepInfo
    nodes: list[fx.Node]
    ins: list[str]
    outs: list[str]
    program: Callable
    piece_kind: str  # its kind as a program piece (tidal.ir.program: segment, collective)


def _classify(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, str]]:
    verdicts: dict[fx.Node, tuple[str, str]] = {}
    tainted: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        v = stop_reason(gm, n)
        origin = next((tainted[a] for a in n.all_input_nodes if a in tainted), None)
        if v is None and origin is not None:
            v = ("eager", f"uses data-dependent value of {origin}")
        if v is not None:
            verdicts[n] = v
            if v[0] == "eager" and (origin is not None or (
                    _written_input(gm, n) is None and _declared_uncaptured(gm, n) is None)):
                tainted[n] = origin or n.name  # an input written in place is data as before
    return verdicts


def _group(gm: fx.GraphModule, verdicts: dict, time_us: Callable[[fx.Node], float],
           piece_us: Optional[float], cuts: frozenset[str] = frozenset()
           ) -> list[tuple[str, list[fx.Node], int, str]]:
    """(kind, nodes, segment, reason) in graph order; a step ends after a node named in
    ``cuts``."""
    groups: list[tuple[str, list[fx.Node], int, str]] = []
    segment, run, run_t = -1, [], 0.0
    prev_captured, cut = False, False
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            cut = cut or n.name in cuts
            continue
        v = verdicts.get(n)
        if v is None:
            if not prev_captured or cut:
                segment += 1
                run, run_t = [], 0.0
            t = time_us(n)
            if piece_us is not None and run and run_t + t > piece_us:
                run, run_t = [], 0.0
            if not run:
                groups.append(("captured", run, segment, ""))
            run.append(n)
            run_t += t
            prev_captured, cut = True, n.name in cuts
            continue
        prev_captured = False
        kind, reason = v
        if kind == "eager" and groups and groups[-1][0] == "eager" and not cut:
            groups[-1][1].append(n)
        else:
            groups.append((kind, [n], -1, reason))
        cut = n.name in cuts
    return groups


def _build_steps(gm: fx.GraphModule, cg: _Codegen, groups, time_us) -> list[_Step]:
    owner: dict[fx.Node, int] = {}
    for k, (_, nodes, _, _) in enumerate(groups):
        for n in nodes:
            owner[n] = k
    steps = []
    for k, (kind, nodes, segment, reason) in enumerate(groups):
        inside = set(nodes)
        ins: list[str] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and cg.var(a) not in ins:
                    ins.append(cg.var(a))
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        last_use: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last_use[a] = i
        body = []
        for i, n in enumerate(nodes):
            body.append(cg.node_line(n))
            dead = [cg.var(a) for a, j in last_use.items()
                    if j == i and a in inside and a not in outs]
            if dead:
                body.append("del " + ", ".join(dead))
        body.append("return (" + "".join(cg.var(n) + ", " for n in outs) + ")")
        program = cg.function(f"step{k}", ins, body)
        label = COLLECTIVE if kind == "boundary" else SEGMENT  # a tidal op between segments
        info = StepInfo(k, kind, tuple(n.name for n in nodes), segment,
                        float(sum(time_us(n) for n in nodes)), reason)
        steps.append(_Step(info, nodes, ins, [cg.var(n) for n in outs], program, label))
    return steps


@contextlib.contextmanager
def _restored(tensors: Sequence[torch.Tensor]):
    """Put ``tensors`` back as they were on exit (what a capture's runs wrote in them)."""
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(tensors, saved):
                t.copy_(value)


def _signature(values: Sequence[Any]) -> tuple:
    """The capture key of ``values``: (shape, dtype, device) of each tensor, each other value
    itself (its type when it cannot be hashed)."""
    return tuple([(v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else
                  _hashable(v) for v in values])


def _hashable(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return type(v)
    return v


class LoweredModule(torch.nn.Module):
    """The lowered form of a graph module: ``forward`` equals ``gm.forward``. Steps are
    captured per input signature (first call with new shapes captures); ``report`` says what
    was captured; ``pieces(*inputs)`` gives the steps as scheduler pieces."""

    def __init__(self, gm: fx.GraphModule, steps: list[_Step], report: LowerReport,
                 backend: Backend, cg: _Codegen, in_place: frozenset[str] = frozenset()):
        super().__init__()
        self.gm = gm
        self.report = report
        self.backend = backend
        self._steps = steps
        self._cg = cg
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._placeholder_vars = [cg.var(n) for n in self._placeholders]
        self._step_pieces = [Piece(f"step{s.info.index}", COMPUTE, kind=s.piece_kind,
                                   duration_us=s.info.predicted_us) for s in steps]
        self._output = next(n for n in gm.graph.nodes if n.op == "output")
        self._names = [n.target for n in self._placeholders]
        self._drivers: dict[tuple, Callable] = {}
        self._captures: dict[tuple, list[Callable]] = {}
        self._free_after = self._plan_frees()
        self._uncaptured = self._make_driver([s.program for s in steps], "uncaptured")
        self._grad_safe = backend.device.type == "cpu"
        written = {w for n in gm.graph.nodes if n.op in ("call_function", "call_method",
                                                          "call_module")
                   for w in _written_inputs(gm, n)}
        # the input variables every capture reads from their own storage (parameters and
        # buffers no step writes): never cloned for capture, never copied before a replay
        self.in_place = frozenset(cg.var(n) for n in self._placeholders
                                  if n.target in in_place and n not in written)
        # buffers the graph writes in place (``self.count.add_(1)``): a capture runs the steps
        # that write them, so they are put back as they were after each capture
        self._written_buffers = tuple({id(t): t for t in (
            fetch_attr(gm, w.target) for w in written if w.op == "get_attr")
            if isinstance(t, torch.Tensor)}.values())
        self._pool = backend.memory_pool()  # this module's captures share one pool of their own

    def _plan_frees(self) -> list[list[str]]:
        last: dict[str, int] = {}
        for k, s in enumerate(self._steps):
            for v in s.ins:
                last[v] = k
        output_vars = {self._cg.var(n) for n in _value_nodes(self._output.args)}
        frees: list[list[str]] = [[] for _ in self._steps]
        for v, k in last.items():
            if v not in output_vars:
                frees[k].append(v)
        return frees

    def _make_driver(self, calls: Sequence[Callable], name: str) -> Callable:
        cg = self._cg
        body = []
        for k, (s, call) in enumerate(zip(self._steps, calls)):
            fn = cg.const(call)
            outs = "".join(v + ", " for v in s.outs)
            body.append(f"{outs}= {fn}({', '.join(s.ins)})" if outs else f"{fn}({', '.join(s.ins)})")
            if self._free_after[k]:
                body.append("del " + ", ".join(self._free_after[k]))
        body.append(f"return {cg.src(self._output.args[0])}")
        params = [cg.var(n) for n in self._placeholders]
        return cg.function(name, params, body)

    def _bind(self, args: tuple, kwargs: dict) -> list[Any]:
        if not kwargs and len(args) == len(self._placeholders):
            return list(args)
        values = list(args) + [None] * (len(self._placeholders) - len(args))
        if len(args) > len(self._placeholders):
            raise TypeError(f"LoweredModule takes {len(self._placeholders)} inputs "
                            f"({', '.join(self._names)}), got {len(args)}")
        for k, v in kwargs.items():
            if k not in self._names:
                raise TypeError(f"LoweredModule got an unexpected input {k!r} "
                                f"(inputs: {', '.join(self._names)})")
            values[self._names.index(k)] = v
        for i in range(len(args), len(values)):
            ph = self._placeholders[i]
            if ph.target not in kwargs:
                if not ph.args:
                    raise TypeError(f"LoweredModule: missing input {ph.target!r}")
                values[i] = ph.args[0]
        return values

    def _captured_calls(self, values: list[Any]) -> list[Callable]:
        """The per-step callables for this input signature, capturing on first use."""
        key = _signature(values)
        calls = self._captures.get(key)
        if calls is None:
            # capture on copies: an uncaptured step that writes an input in place (a
            # BatchNorm statistic) runs during capture, and must not write the real one
            with _restored(self._written_buffers):
                calls = self._capture(values)
            self._captures[key] = calls
            self._drivers[key] = self._make_driver(calls, "captured")
        return calls

    def _capture(self, values: list[Any]) -> list[Callable]:
        """Each step's callable for the signature of ``values``, captured steps captured."""
        env = {}
        for n, v in zip(self._placeholders, values):
            var = self._cg.var(n)
            keep = var in self.in_place or not isinstance(v, torch.Tensor)
            env[var] = v if keep else v.detach().clone()
        calls = []
        for k, s in enumerate(self._steps):
            ins = [env[v] for v in s.ins]
            call = s.program
            if self.report.steps[k].kind == "captured":
                try:
                    call = self.backend.capture(
                        s.program, ins, pool=self._pool,
                        in_place=[i for i, v in enumerate(s.ins)
                                  if v in self.in_place]).replay
                except CaptureError as e:
                    self._capture_failed(k, e)
            env.update(zip(s.outs, call(*ins)))
            calls.append(call)
        return calls

    def _capture_failed(self, k: int, error: CaptureError) -> None:
        """Step ``k`` could not be captured: it runs as it is from now on (every signature),
        and the report says so (kind ``eager``, the error as the reason), with a warning."""
        info = self.report.steps[k]
        reason = f"capture failed: {error}"
        steps = list(self.report.steps)
        steps[k] = dataclasses.replace(info, kind="eager", reason=reason)
        self.report = dataclasses.replace(self.report, steps=tuple(steps))
        warnings.warn(f"tidal lower: step {k} ({info.nodes[0]} .. {info.nodes[-1]}) runs "
                      f"uncaptured: {reason}", RuntimeWarning, stacklevel=3)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._bind(args, kwargs)
        if not self._grad_safe and torch.is_grad_enabled() and self._needs_grad(values):
            return self._uncaptured(*values)  # a CUDA graph replay would drop autograd
        key = _signature(values)
        driver = self._drivers.get(key)
        if driver is None:
            self._captured_calls(values)
            driver = self._drivers[key]
        return driver(*values)

    def _needs_grad(self, values: Sequence[Any]) -> bool:
        """Whether autograd would record this call: an input or a parameter requires grad
        (grad mode alone does not: a forward of a frozen model still replays its captures)."""
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values) or \
            any(p.requires_grad for p in self.gm.parameters())

    def pieces(self, *args: Any, **kwargs: Any) -> "PieceRun":
        """The steps as the scheduler's bound pieces over a fresh environment
        (``tidal.ir.program.Piece`` objects, each with the function that runs it); after
        running them in order, ``.result()`` is the forward's output."""
        values = self._bind(args, kwargs)
        calls = self._captured_calls(values)
        return PieceRun(self, values, calls)


class PieceRun:
    """One forward as a list of bound pieces (``tidal.runtime.scheduling.pieces.BoundPiece``:
    a ``step<k>`` piece on the compute stream, of its predicted duration, and the function that
    runs it; run them in order)."""

    def __init__(self, lowered: LoweredModule, values: list[Any], calls: list[Callable]):
        self._lowered = lowered
        self._env = dict(zip(lowered._placeholder_vars, values))
        self.pieces = [BoundPiece(piece, self._runner(k, s, call)) for k, (piece, s, call)
                       in enumerate(zip(lowered._step_pieces, lowered._steps, calls))]

    def _runner(self, k: int, step: _Step, call: Callable) -> Callable[[], None]:
        env, frees = self._env, self._lowered._free_after[k]

        def run() -> None:
            outs = call(*[env[v] for v in step.ins])
            env.update(zip(step.outs, outs))
            for v in frees:
                env.pop(v, None)
        return run

    def value(self, node: fx.Node) -> Any:
        """The value of ``node`` once the piece that computes it ran (a node whose value is
        freed after its last use is gone; outputs never are)."""
        return self._env[self._lowered._cg.var(node)]

    def computed(self, node: fx.Node) -> bool:
        """Whether the value of ``node`` is at hand (computed by a piece that ran, not freed)."""
        return self._lowered._cg.var(node) in self._env

    def result(self) -> Any:
        """The forward's output (after every piece ran)."""
        lowered = self._lowered
        return fx.node.map_arg(lowered._output.args[0], lambda n: fetch_attr(
            lowered.gm, n.target) if n.op == "get_attr" else self._env[lowered._cg.var(n)])


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any], *, device: Any = None,
          backend: Optional[Backend] = None, piece_us: Optional[float] = None,
          cluster: Optional[Cluster] = None,
          time_us: Optional[Callable[[fx.Node], float]] = None,
          cuts: Sequence[str] = (), in_place: Sequence[str] = ()) -> LoweredModule:
    """Lower ``gm`` into captured segments (see the module docstring) and capture them on
    ``example_inputs``.

    ``device``/``backend``: where it runs (default: the device of the first parameter or input;
    ``backend_for(device)``). ``piece_us``: split captured segments into pieces predicted under
    this many µs (None: no split). Predictions come from ``time_us(node)`` or else
    ``node_time_us(gm, node, batch, cluster)`` (annotating ``gm`` if it has no costs).
    ``cuts``: names of nodes after which a step always ends (a program's segment boundaries).
    ``in_place``: names of inputs (placeholders) that keep their storage from call to call
    (parameters, buffers): captures read them where they are instead of copying them into
    static buffers (an input some step writes in place is still copied).
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"lower: expected a torch.fx.GraphModule, got {type(gm).__name__}")
    inputs = bind_inputs(gm, example_inputs, "lower example_inputs")
    if backend is None:
        if device is None:
            tensors = [p for p in gm.parameters()] + [t for t in inputs
                                                      if isinstance(t, torch.Tensor)]
            device = tensors[0].device if tensors else "cpu"
        backend = backend_for(device)
    if time_us is None:
        time_us = _cost_time_fn(gm, inputs, cluster) if piece_us is not None else (lambda n: 0.0)
    verdicts = _classify(gm)
    cg = _Codegen(gm)
    steps = _build_steps(gm, cg, _group(gm, verdicts, time_us, piece_us, frozenset(cuts)),
                         time_us)
    report = LowerReport(tuple(s.info for s in steps), piece_us)
    lowered = LoweredModule(gm, steps, report, backend, cg, frozenset(in_place))
    with torch.no_grad():
        lowered._captured_calls(lowered._bind(inputs, {}))
    return lowered


def _cost_time_fn(gm: fx.GraphModule, inputs: tuple, cluster: Optional[Cluster]
                  ) -> Callable[[fx.Node], float]:
    from tidal.ir import cost

    if not any(meta.get_cost(n) is not None for n in gm.graph.nodes):
        cost.annotate(gm, inputs)
    batch = cost.example_batch(inputs)
    cl = cluster or Cluster(gpus=1)
    node_us = cost.node_times_us(gm, batch, cl)
    return lambda n: node_us.get(n.name, (0.0, 0.0))[0]
