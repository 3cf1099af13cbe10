"""Batch-dimension analysis: which dimension of every value of a traced graph holds the samples.

The graph is run twice with FakeTensors (no memory, no arithmetic): at the example batch ``B``
and at ``2B`` (the inputs' dimension 0 tiled). A dimension whose size changes is affine in the
batch, ``k*B + c``: with ``c == 0`` it holds the samples (``k == 1``) or the samples *folded* with
``k`` other rows each (Swin's window partition ``[B, H, W, C] -> [B*nW, ws, ws, C]``); a value
whose shape does not change carries no samples. Op rules then check what shapes alone cannot
tell:

- dataflow: a value with no sample dimension is *replicated* only if nothing it was computed from
  carries samples, otherwise it is *reduced* (a sum over samples, one selected sample);
- reshapes (``view``/``reshape``/``flatten``/``unflatten``) keep the samples as the outer part of
  a dimension only if the elements before that dimension are the same before and after (the
  unfolding ``view(B, ...)`` restores dimension 0; ``[T, B, C] -> [T*B, C]`` interleaves them);
- any other op may carry a fold factor of an input along, never create one (``cat`` along the
  sample dimension, ``repeat`` along it);
- ops that mix values along a dimension (``softmax``, ``cumsum``, ``flip``, ``sort``, ...) must
  not do it along the sample dimension;
- ``getitem`` on a tuple takes the element's fact; Python numbers are *replicated* when they do
  not change with the batch (a sequence length) and *size* when they are ``k*B`` (``x.size(0)``).

Whatever the rules cannot decide is *unknown*, with a reason naming the node; values computed
from an unknown value are unknown too ("follows ..."). Each node's fact is recorded with
``tidal.ir.meta.set_batch_dim``: a ``BatchDim`` for a tensor or number, a tuple of facts (nested
like the value) for a tuple, list or dict output. The output node gets none.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import batch_dim
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         pos = torch.arange(x.size(1))
    ...         y = self.lin(x) + pos[:, None]
    ...         return y.view(-1, 4).sum(0)
    >>> gm = fx.symbolic_trace(M())
    >>> facts = batch_dim.analyze(gm, (torch.randn(2, 3, 4),), batch_size=2)
    >>> facts["arange"].kind, facts["add"].kind, facts["add"].dim
    ('replicated', 'batch', 0)
    >>> facts["view"]
    BatchDim(kind='folded', dim=0, factor=3, reason='')
    >>> facts["view"].rows(1, 2)
    slice(3, 6, None)
    >>> facts["sum_1"].kind
    'reduced'
    >>> batch_dim.unknown_nodes(gm)
    []
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from tidal.ir import meta
from tidal.ir.cost import materialize
from tidal.ir.inputs import bind_inputs
from tidal.ir.node_runner import map_tensors, op_name

BATCH, FOLDED, REPLICATED, REDUCED, SIZE, UNKNOWN = (
    "batch", "folded", "replicated", "reduced", "size", "unknown")
KINDS = (BATCH, FOLDED, REPLICATED, REDUCED, SIZE, UNKNOWN)
"""The kinds of :class:`BatchDim`, in the order :func:`node_kind` gives them precedence
(reversed): unknown wins over batch, batch over folded, and so on."""


@dataclass(frozen=True)
class BatchDim:
    """Where one value (a tensor, or a Python number) holds the samples of the batch.

    ``kind``:
      - ``batch``: dimension ``dim`` has one row per sample (size ``B``);
      - ``folded``: dimension ``dim`` has size ``factor*B``, the samples its outer part (the rows
        of sample ``s`` are ``s*factor ... (s+1)*factor - 1``);
      - ``replicated``: no samples; the same whatever the batch (parameters, buffers, position
        ids, masks built from constants, sequence lengths);
      - ``reduced``: no sample dimension, but computed from samples (a sum or mean over them, one
        selected sample): a shard of the batch would compute something else;
      - ``size``: a Python number that is ``factor*B`` (``x.size(0)``);
      - ``unknown``: the analysis cannot tell; ``reason`` names the node and says why.
    """

    kind: str
    dim: Optional[int] = None
    factor: int = 1
    reason: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"BatchDim kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def splits(self) -> bool:
        """Whether the value can be cut by samples along ``dim`` (``batch`` or ``folded``)."""
        return self.kind in (BATCH, FOLDED)

    def rows(self, start: int, stop: int) -> slice:
        """The index range along ``dim`` that holds samples ``start .. stop-1``."""
        if not self.splits:
            raise ValueError(f"a {self.kind} value has no sample rows")
        return slice(start * self.factor, stop * self.factor)


Fact = Union[BatchDim, tuple]
"""A node's fact: a ``BatchDim``, or a tuple of facts nested like a tuple/list/dict output."""


def leaves(fact: Optional[Fact]) -> Iterator[BatchDim]:
    """The ``BatchDim`` leaves of a (possibly nested) fact, in order."""
    if isinstance(fact, BatchDim):
        yield fact
    elif isinstance(fact, tuple):
        for f in fact:
            yield from leaves(f)


def node_kind(fact: Optional[Fact]) -> Optional[str]:
    """One kind for a whole node: the most telling kind among its leaves (unknown, then batch,
    folded, reduced, size, replicated); None for no fact."""
    kinds = {leaf.kind for leaf in leaves(fact)}
    for kind in (UNKNOWN, BATCH, FOLDED, REDUCED, SIZE, REPLICATED):
        if kind in kinds:
            return kind
    return REPLICATED if fact is not None else None


def is_batched(node: fx.Node) -> bool:
    """Whether any value the node outputs holds samples (kind ``batch`` or ``folded``)."""
    return any(leaf.splits for leaf in leaves(meta.get_batch_dim(node)))


def replicated(node: fx.Node) -> bool:
    """Whether everything the node outputs is the same whatever the batch (analysed nodes only)."""
    fact = meta.get_batch_dim(node)
    return fact is not None and all(leaf.kind == REPLICATED for leaf in leaves(fact))


def unknown_nodes(gm: fx.GraphModule, roots_only: bool = False) -> list[tuple[fx.Node, str]]:
    """``(node, reason)`` for every node with an unknown value; with ``roots_only``, leave out
    the nodes that are unknown only because an input is (``follows ...``)."""
    out = []
    for n in gm.graph.nodes:
        reasons = [leaf.reason for leaf in leaves(meta.get_batch_dim(n)) if leaf.kind == UNKNOWN]
        if reasons and not (roots_only and reasons[0].startswith(f"{n.name}: follows")):
            out.append((n, reasons[0]))
    return out


def summary(gm: fx.GraphModule) -> dict[str, int]:
    """How many analysed nodes are of each kind (:func:`node_kind`)."""
    counts = dict.fromkeys(KINDS, 0)
    for n in gm.graph.nodes:
        kind = node_kind(meta.get_batch_dim(n))
        if kind is not None:
            counts[kind] += 1
    return counts


# --- observing shapes at two batch sizes -----------------------------------------------------

@dataclass(frozen=True)
class _Failed:
    """A node that did not run at some batch: ``origin`` is the node that raised."""

    origin: str
    error: str


def _summarize(value: Any) -> Any:
    """What the analysis keeps of a value: a tensor's shape, a container's elements, else the
    value itself."""
    if isinstance(value, torch.Tensor):
        return _Shape(tuple(int(d) for d in value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(_summarize(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(_summarize(v) for v in value.values())
    return value


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


class _ShapeRecorder(fx.Interpreter):
    """Runs the graph on FakeTensors, recording each node's summarized output; a node that
    raises (and every node after it that needs its value) is recorded as ``_Failed``. Nodes
    FakeTensors cannot run (data-dependent ops) are run for real on placeholder data."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm, garbage_collect_values=True)
        self.mode = mode
        self.seen: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        failed = [self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), _Failed)]
        if failed:
            out = failed[0]
        else:
            try:
                out = super().run_node(n)
            except Exception as fake_error:  # noqa: BLE001 - recorded, the node becomes unknown
                out = self._run_real(n, fake_error)
        self.seen[n.name] = out if isinstance(out, _Failed) else _summarize(out)
        return out

    def _run_real(self, n: fx.Node, fake_error: Exception) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return _Failed(n.name, _message(fake_error))
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        with unset_fake_temporarily():
            args, kwargs = map_tensors((args, kwargs), materialize)
            try:
                with torch.no_grad():
                    out = getattr(self, n.op)(n.target, args, kwargs)
            except Exception as e:  # noqa: BLE001
                return _Failed(n.name, _message(e))
        return map_tensors(out, self.mode.from_tensor)


def _message(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _rebatch(v: Any, batch_size: int, b: int) -> Any:
    """An input at batch ``b``: dimension 0 of a tensor input of ``batch_size`` rows tiled."""
    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size:
        return v[torch.arange(b) % batch_size]
    return v


def _observe(gm: fx.GraphModule, inputs: Sequence[Any], batch_size: int, b: int) -> dict:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rebatched = [_rebatch(v, batch_size, b) for v in inputs]
    with mode:
        fake = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in rebatched]
        recorder = _ShapeRecorder(gm, mode)
        try:
            recorder.run(*fake)
        except Exception:  # noqa: BLE001 - only the output node can get here; nodes are recorded
            pass
    return recorder.seen


# --- the rules ---------------------------------------------------------------------------------

_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as",
                       "_unsafe_view"})
"""Ops whose output may fold (or unfold) the samples into another dimension."""

_METADATA_ONLY = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor",
                            "zeros_like", "ones_like", "empty_like", "full_like"})
"""Ops that read only the shape, dtype and device of their tensor argument."""

_MIXING = {"softmax": (1, -1), "log_softmax": (1, -1), "cumsum": (1, None),
           "cumprod": (1, None), "cummax": (1, None), "cummin": (1, None),
           "logcumsumexp": (1, None), "flip": (1, None), "roll": (2, None), "sort": (1, -1),
           "argsort": (1, -1)}
"""Ops that combine or reorder values along a dimension: op name -> (position of the ``dim``
argument, its default)."""


def _render(v: Any) -> str:
    if isinstance(v, fx.Node):
        return v.name
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_render(x) for x in v) + ")"
    return repr(v)


def _describe(n: fx.Node) -> str:
    """``view_3 = view(32, 4, 4, 16)`` (the tensor the op is called on left out)."""
    args = n.args[1:] if n.op in ("call_method", "call_module") else n.args
    parts = [_render(a) for a in args] + [f"{k}={_render(v)}" for k, v in n.kwargs.items()]
    return f"{n.name} = {op_name(n)}({', '.join(parts)})"


def _input_leaves(n: fx.Node, facts: Mapping[str, Fact]) -> list[tuple[fx.Node, BatchDim]]:
    return [(a, leaf) for a in n.all_input_nodes for leaf in leaves(facts.get(a.name))]


def _first_tensor_arg(n: fx.Node, before: Mapping[str, Any]) -> Optional[fx.Node]:
    for a in n.all_input_nodes:
        if isinstance(before.get(a.name), _Shape):
            return a
    return None


def _scaling(s0: int, s1: int, b0: int, b1: int) -> tuple[Fraction, Fraction]:
    k = Fraction(s1 - s0, b1 - b0)
    return k, s0 - k * b0


class _Rules:
    """The per-node decision, given the facts of the nodes before it and the observed values."""

    def __init__(self, gm: fx.GraphModule, facts: dict, seen0: dict, seen1: dict,
                 b0: int, b1: int, batch_size: int):
        self.gm, self.facts, self.seen0, self.seen1 = gm, facts, seen0, seen1
        self.b0, self.b1, self.batch_size = b0, b1, batch_size

    def record(self, n: fx.Node) -> None:
        """Decide ``n``'s fact and record it (in ``facts`` and the node meta)."""
        self._set(n, self._node(n))
        if mutates(n) and isinstance(n.args[0], fx.Node):
            self._written(n, n.args[0])

    def _set(self, n: fx.Node, fact: Fact) -> None:
        self.facts[n.name] = fact
        meta.set_batch_dim(n, fact)

    def _written(self, n: fx.Node, target: fx.Node) -> None:
        """An in-place op writing values computed from samples into a value that had none
        makes that value (for the nodes after ``n``) unknown."""
        before = self.facts.get(target.name)
        writers = [a for a, leaf in _input_leaves(n, self.facts)
                   if a is not target and leaf.kind in (BATCH, FOLDED, REDUCED)]
        if writers and isinstance(before, BatchDim) and before.kind in (REPLICATED, REDUCED):
            self._set(target, BatchDim(UNKNOWN, reason=(
                f"{target.name}: written in place by {_describe(n)} with values computed from "
                f"the samples of {writers[0].name}")))

    def _node(self, n: fx.Node) -> Fact:
        o0, o1 = self.seen0.get(n.name), self.seen1.get(n.name)
        if n.op == "get_attr":
            return self._all(o0, BatchDim(REPLICATED, reason="parameter or buffer"))
        if n.op == "placeholder":
            return self._placeholder(o0)
        inputs = _input_leaves(n, self.facts)
        for a, leaf in inputs:
            if leaf.kind == UNKNOWN:
                why = f"{n.name}: follows unknown {a.name}"
                return self._all(o0, BatchDim(UNKNOWN, reason=why))
        for o, b in ((o0, self.b0), (o1, self.b1)):
            if isinstance(o, _Failed):
                if o.origin != n.name:
                    why = f"{n.name}: follows {o.origin}, which fails at batch {b}"
                else:
                    why = (f"{self._what(n)} fails at batch {b} ({o.error}): its shape is fixed, "
                           f"so cannot tell which output dim holds the {self.b0} samples")
                return BatchDim(UNKNOWN, reason=why)
        if n.op == "call_function" and op_name(n) == "getitem":
            picked = self._getitem(n)
            if picked is not None:
                return picked
        return self._value(n, o0, o1, inputs)

    def _what(self, n: fx.Node) -> str:
        """``view_3 = view(32, 4, 4, 16) of a [2, 16, 16, 16] value``, for reasons."""
        first = _first_tensor_arg(n, self.seen0)
        if first is None:
            return _describe(n)
        return f"{_describe(n)} of a {list(self.seen0[first.name].shape)} value"

    def _all(self, o: Any, fact: BatchDim) -> Fact:
        """``fact`` for every leaf of the value ``o``."""
        if isinstance(o, tuple):
            return tuple(self._all(v, fact) for v in o)
        return fact

    def _placeholder(self, o: Any) -> Fact:
        if isinstance(o, _Shape) and o.shape and o.shape[0] == self.batch_size:
            return BatchDim(BATCH, 0, reason="model input")
        return self._all(o, BatchDim(REPLICATED, reason="model input without the batch"))

    def _getitem(self, n: fx.Node) -> Optional[Fact]:
        src, index = n.args[0], n.args[1]
        fact = self.facts.get(src.name) if isinstance(src, fx.Node) else None
        if isinstance(fact, tuple) and isinstance(index, int) and -len(fact) <= index < len(fact):
            return fact[index]
        return None

    def _value(self, n: fx.Node, o0: Any, o1: Any, inputs) -> Fact:
        if isinstance(o0, tuple) and isinstance(o1, tuple) and len(o0) == len(o1):
            return tuple(self._value(n, a, b, inputs) for a, b in zip(o0, o1))
        if isinstance(o0, _Shape) and isinstance(o1, _Shape):
            return self._tensor(n, o0.shape, o1.shape, inputs)
        if isinstance(o0, (_Shape, tuple)) or isinstance(o1, (_Shape, tuple)):
            return BatchDim(UNKNOWN, reason=f"{_describe(n)}: its output's structure changes "
                                            f"with the batch")
        return self._number(n, o0, o1)

    def _number(self, n: fx.Node, v0: Any, v1: Any) -> BatchDim:
        try:
            same = bool(v0 == v1)
        except Exception:  # noqa: BLE001 - values that do not compare
            same = repr(v0) == repr(v1)
        if same:
            return BatchDim(REPLICATED)
        if isinstance(v0, int) and isinstance(v1, int) and not isinstance(v0, bool):
            k, c = _scaling(v0, v1, self.b0, self.b1)
            if c == 0 and k.denominator == 1 and k > 0:
                return BatchDim(SIZE, factor=int(k))
        return BatchDim(UNKNOWN, reason=f"{_describe(n)} is {v0!r} at batch {self.b0} and "
                                        f"{v1!r} at batch {self.b1}: not a multiple of the batch")

    def _tensor(self, n: fx.Node, s0: tuple, s1: tuple, inputs) -> BatchDim:
        name = op_name(n)
        first = _first_tensor_arg(n, self.seen0)
        what = self._what(n)
        if len(s0) != len(s1):
            return BatchDim(UNKNOWN, reason=f"{what}: its rank changes with the batch")
        carriers = [(a, leaf) for a, leaf in inputs if leaf.kind in (BATCH, FOLDED, SIZE, REDUCED)
                    and not (name in _METADATA_ONLY and a is first)]
        grows = [(d, *_scaling(x, y, self.b0, self.b1))
                 for d, (x, y) in enumerate(zip(s0, s1)) if x != y]
        if not grows:
            if carriers:
                return BatchDim(REDUCED, reason=f"computed from the samples of "
                                                f"{carriers[0][0].name}, with no sample dim")
            return BatchDim(REPLICATED)
        if len(grows) > 1:
            dims = " and ".join(str(d) for d, _, _ in grows)
            return BatchDim(UNKNOWN, reason=f"{what}: dims {dims} all grow with the batch")
        dim, k, c = grows[0]
        if c != 0 or k.denominator != 1 or k <= 0:
            return BatchDim(UNKNOWN, reason=f"{what}: dim {dim} has size {s0[dim]} at batch "
                                            f"{self.b0} and {s1[dim]} at batch {self.b1}, not a "
                                            f"whole multiple of the batch; cannot tell which "
                                            f"rows hold which samples")
        if not carriers:
            return BatchDim(UNKNOWN, reason=f"{what}: dim {dim} grows with the batch but no "
                                            f"input carries samples")
        reduced = [a for a, leaf in carriers if leaf.kind == REDUCED]
        if reduced:
            return BatchDim(UNKNOWN, reason=f"{what}: combines {reduced[0].name}, computed from "
                                            f"all samples, with per-sample rows")
        fact = BatchDim(BATCH if k == 1 else FOLDED, dim, int(k))
        if self._is_reshape(n):
            return self._reshape(n, what, first, s0, fact)
        if fact.factor not in {leaf.factor for _, leaf in carriers}:
            return BatchDim(UNKNOWN, reason=f"{what}: dim {dim} holds {fact.factor} rows per "
                                            f"sample, which no input has, and {name} is not a "
                                            f"reshape: cannot tell which rows hold which samples")
        return self._mixing(n, what, fact)

    def _is_reshape(self, n: fx.Node) -> bool:
        if n.op == "call_module":
            return isinstance(self.gm.get_submodule(str(n.target)),
                              (torch.nn.Flatten, torch.nn.Unflatten))
        return op_name(n) in _RESHAPES

    def _reshape(self, n: fx.Node, what: str, first: Optional[fx.Node], s0: tuple,
                 fact: BatchDim) -> BatchDim:
        src = self.facts.get(first.name) if first is not None else None
        if not isinstance(src, BatchDim) or not src.splits:
            return BatchDim(UNKNOWN, reason=f"{what}: the output grows with the batch but the "
                                            f"reshaped value has no sample dim")
        before_in = math.prod(self.seen0[first.name].shape[:src.dim])
        before_out = math.prod(s0[:fact.dim])
        if before_in != before_out:
            return BatchDim(UNKNOWN, reason=f"{what}: the samples (dim {src.dim}) end up inside "
                                            f"dim {fact.dim}, interleaved with the "
                                            f"{before_in} elements before them; cannot tell "
                                            f"which output dim holds the {self.b0} samples")
        return fact

    def _mixing(self, n: fx.Node, what: str, fact: BatchDim) -> BatchDim:
        name = op_name(n)
        if n.op == "call_module":
            mod = self.gm.get_submodule(str(n.target))
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.training:
                return BatchDim(fact.kind, fact.dim, fact.factor,
                                "BatchNorm in training mode: statistics over the samples "
                                "(per shard when split)")
            if isinstance(mod, (torch.nn.Softmax, torch.nn.LogSoftmax)) and mod.dim is not None:
                dims = mod.dim
            else:
                return fact
        elif name in _MIXING:
            pos, default = _MIXING[name]
            dims = n.kwargs.get("dims", n.kwargs.get("dim", n.args[pos] if len(n.args) > pos
                                                      else default))
        else:
            return fact
        if dims is None:
            return BatchDim(UNKNOWN, reason=f"{what}: {name} over all elements mixes the samples")
        seen = self.seen0[n.name]   # sort, cummax: (values, indices) of one shape
        rank = len((seen[0] if isinstance(seen, (tuple, list)) else seen).shape)
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        if any(isinstance(d, int) and d % max(rank, 1) == fact.dim for d in dims):
            return BatchDim(UNKNOWN, reason=f"{what}: {name} along dim {fact.dim}, the sample "
                                            f"dim, mixes the samples")
        return fact


def mutates(n: fx.Node) -> bool:
    """Whether ``n`` writes into its first argument (``x[i] = v``, ``x.masked_fill_(...)``)."""
    if not n.args:
        return False
    name = op_name(n)
    if n.op == "call_function":   # an aten operator's in-place variant (``aten.add_``)
        return name == "setitem" or isinstance(n.target, torch._ops.OpOverload) and \
            name.endswith("_") and not name.endswith("__")
    return n.op == "call_method" and name.endswith("_") and not name.endswith("__")


def analyze(gm: fx.GraphModule, example_inputs: Any, batch_size: int) -> dict[str, Fact]:
    """The batch-dimension fact of every node of ``gm`` (by node name, the output node left out),
    also recorded with ``tidal.ir.meta.set_batch_dim``.

    ``example_inputs`` are the model's inputs (a tuple, or a dict of keyword inputs as for
    ``tidal.trace``) at ``batch_size`` samples; every tensor input whose dimension 0 has
    ``batch_size`` rows is a batched input, the others are replicated. Nothing runs on real data
    except single nodes FakeTensors cannot run; ``gm`` is not changed beyond its node meta (its
buffers, such as BatchNorm's running statistics, are restored after the runs).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    inputs = bind_inputs(gm, example_inputs)
    b0, b1 = batch_size, 2 * batch_size
    state = [(t, t.detach().clone()) for t in gm.buffers()]
    try:
        seen0 = _observe(gm, inputs, batch_size, b0)
        seen1 = _observe(gm, inputs, batch_size, b1)
    finally:  # the model's state stays as it was (BatchNorm's running statistics)
        with torch.no_grad():
            for t, saved in state:
                t.copy_(saved)
    facts: dict[str, Fact] = {}
    rules = _Rules(gm, facts, seen0, seen1, b0, b1, batch_size)
    for n in gm.graph.nodes:
        if n.op != "output":
            rules.record(n)
    return facts
