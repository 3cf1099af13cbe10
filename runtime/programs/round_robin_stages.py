"""The partitions of a graph the ``round_robin`` pass split: what each computes, reads, sends
and owns.

The pass splits the traced model into ``submod_0 .. submod_{N-1}`` called in order from the
top level. :class:`Partitions` reads that split graph once: per partition its :class:`Stage`
(the submodule, its arguments, the top-level values it produces and those it sends on to the
next rank: every value live after it), the trainable parameters it uses (its submodule's and
those the top level hands it through ``get_attr``), the parameters it owns (each owned by the
lowest partition using it, whose backward runs last: ``tidal.ir.param_owners.first_owners``;
every trainable parameter of the model must be owned, :func:`check_all_owned`) and the
floating-point buffers it averages (each in its first partition). :meth:`Partitions.constants`
is what a partition reads besides its parameters and float activations.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.compat import split_module_tuple   # how the pass splits the graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> split = split_module_tuple(fx.symbolic_trace(model), model, lambda n: int(n.name == "_2"))
    >>> parts = Partitions(split, 2, model)
    >>> [st.sends for st in parts.stages], [[k for k, _ in part] for part in parts.owned]
    ... # doctest: +NORMALIZE_WHITESPACE
    ([('getitem',), ('getitem_1',)],
     [['submod_0.0.weight', 'submod_0.0.bias'], ['submod_1.2.weight', 'submod_1.2.bias']])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from tidal.ir.errors import PlanError
from tidal.ir.node_runner import fetch_attr
from tidal.ir.param_owners import first_owners, unowned


def check_all_owned(root: torch.nn.Module, owned_ids: set[int]) -> None:
    """Raise ``PlanError`` naming the trainable parameters of ``root`` whose ids are not in
    ``owned_ids``: no partition would all-reduce them, so the ranks' copies would drift apart
    while the loss still looks right.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> check_all_owned(m, {id(m.weight)})
        Traceback (most recent call last):
        ...
        tidal.ir.errors.PlanError: round_robin: parameter(s) 'bias' belong to no partition, ...
    """
    left = unowned(root, owned_ids)
    if left:
        raise PlanError(f"round_robin: parameter(s) {', '.join(map(repr, left[:5]))}"
                        f"{' and more' if len(left) > 5 else ''} belong to no partition, so "
                        "their gradients would never be all-reduced and the ranks would drift "
                        "apart")


@dataclass(frozen=True)
class Stage:
    """One partition of the split graph: its submodule, the arguments the top level calls it
    with, the top-level values it produces and those it sends to the next rank."""

    module: torch.nn.Module
    args: tuple[fx.Node, ...]
    produced: tuple[str, ...]      # names of the top-level values this partition outputs
    sends: tuple[str, ...]         # names live after this partition (sent to the next rank)


class StageParam(NamedTuple):
    """A trainable parameter a partition uses: its ``name`` (``submod_p.<local>`` or the
    top-level ``get_attr`` target), the parameter, and its name inside the partition's
    submodule (None for one the top level hands over through ``get_attr``)."""

    name: str
    param: torch.nn.Parameter
    local: Optional[str]


def floats(values: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of ``values`` (what carries a gradient)."""
    return [k for k, v in values.items() if v.is_floating_point()]


def _stages(split: fx.GraphModule, n: int) -> list[Stage]:
    """Each partition's :class:`Stage`, in call order. Raises ``ValueError`` when the split
    graph does not have ``n`` partitions."""
    g = split.graph
    calls = [x for x in g.nodes if x.op == "call_module"]
    if len(calls) != n:
        raise ValueError(f"round_robin: the split graph has {len(calls)} partitions, "
                         f"the plan {n}")
    part_of: dict[str, int] = {}
    produced: list[list[str]] = [[] for _ in calls]
    for p, call in enumerate(calls):
        for u in call.users:
            part_of[u.name] = p
            produced[p].append(u.name)
    last_use: dict[str, int] = {}
    for p, call in enumerate(calls):
        for a in call.args:
            if isinstance(a, fx.Node) and a.op != "placeholder":
                last_use[a.name] = max(last_use.get(a.name, -1), p)
    out_node = next(x for x in g.nodes if x.op == "output")
    for a in out_node.all_input_nodes:
        if a.op != "placeholder":
            last_use[a.name] = n
    order = [x.name for x in g.nodes]
    return [Stage(split.get_submodule(call.target), tuple(call.args), tuple(produced[p]),
                  tuple(nm for nm in order if nm in part_of and part_of[nm] <= p
                        and last_use.get(nm, -1) > p))
            for p, call in enumerate(calls)]


class _Probe(torch.nn.Module):
    """Runs the split graph and returns every top-level value by node name (for shapes)."""

    def __init__(self, split: fx.GraphModule):
        super().__init__()
        self.split = split

    def forward(self, *args: Any) -> dict[str, Any]:
        interp = fx.Interpreter(self.split, garbage_collect_values=False)
        interp.run(*args)
        return {n.name: v for n, v in interp.env.items()}


class Partitions:
    """The partitions of the split graph ``split`` (see the module docstring); ``model`` is the
    module whose trainable parameters must each be owned by one partition."""

    def __init__(self, split: fx.GraphModule, n: int, model: torch.nn.Module):
        self.split, self.n = split, n
        self.stages = _stages(split, n)
        self.placeholders = [x for x in split.graph.nodes if x.op == "placeholder"]
        self.output = next(x for x in split.graph.nodes if x.op == "output")
        self.params = [self._params(p) for p in range(n)]
        # each trainable parameter once (one may reach a partition both ways)
        self.trainable = [list(dict.fromkeys(x.param for x in ps)) for ps in self.params]
        self.owned = first_owners([[(x.name, x.param) for x in ps] for ps in self.params])
        check_all_owned(model, {id(prm) for part in self.owned for _, prm in part})
        # (name, parameter) per partition, each parameter once: what a switch moves
        self.named = [list({id(x.param): (x.name, x.param) for x in ps}.values())
                      for ps in self.params]
        self.buffers = [[b for _, b in part] for part in first_owners(
            [[("", b) for b in st.module.buffers() if b.is_floating_point()]
             for st in self.stages])]

    def _params(self, p: int) -> list[StageParam]:
        """The trainable parameters partition ``p`` uses: its submodule's and those the top
        level hands it through ``get_attr`` (``x + self.pos_embedding``, a ``cls_token``,
        weights used through ``addmm``)."""
        st = self.stages[p]
        named = [StageParam(f"submod_{p}.{k}", prm, k) for k, prm in st.module.named_parameters()]
        for a in st.args:
            value = fetch_attr(self.split, a.target) if a.op == "get_attr" else None
            if isinstance(value, torch.nn.Parameter):
                named.append(StageParam(str(a.target), value, None))
        return [x for x in named if x.param.requires_grad]

    def micro_values(self, inputs: tuple) -> dict[str, Any]:
        """Every top-level value of the split graph on one micro-batch (what crosses each cut):
        a forward without autograd on copies of the buffers, so no statistic changes."""
        state = {f"split.{k}": v.clone() for k, v in self.split.named_buffers()}
        with torch.no_grad():
            return torch.func.functional_call(_Probe(self.split), state, tuple(inputs))

    def constants(self, p: int, received: dict[str, Any], inputs: tuple, target: Any) -> Any:
        """What partition ``p`` reads besides its trainable parameters and float activations:
        its submodule's buffers and frozen parameters, the top-level attributes it is handed,
        the model inputs, its integer activations and (last partition) the targets."""
        st = self.stages[p]
        trainable = {x.local for x in self.params[p]}
        state = {k: v for k, v in [*st.module.named_parameters(), *st.module.named_buffers()]
                 if k not in trainable}
        attrs = {str(a.target): fetch_attr(self.split, a.target) for a in st.args
                 if a.op == "get_attr"}
        attrs = {k: v for k, v in attrs.items()
                 if not (isinstance(v, torch.nn.Parameter) and v.requires_grad)}
        ints = {k: v for k, v in received.items() if not v.is_floating_point()}
        values = [self.input(x, inputs) for x in self.placeholders]
        return state, attrs, values, ints, target if p == self.n - 1 else None

    def label(self, path: tuple) -> str:
        """What a constant at ``path`` in :meth:`constants`'s value is, in words."""
        kind, key = path[0].idx, getattr(path[1], "key", None) if len(path) > 1 else None
        if kind == 2:
            return f"input {self.placeholders[path[1].idx].target}"
        return ("buffer", "attribute", "", "activation", "targets")[kind] + (
            f" {key}" if key is not None else "")

    def sent(self, p: int, name: str, value: Any) -> torch.Tensor:
        """``value``, which partition ``p`` sends on as ``name``; raises ``TypeError`` unless
        it is a tensor."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"round_robin: value {name!r} crossing from partition {p} "
                            f"is a {type(value).__name__}, not a tensor")
        return value

    def input(self, node: fx.Node, inputs: tuple) -> Any:
        """The value of a model-input placeholder (the batch slice, or its pinned default) or
        of a top-level attribute."""
        if node.op == "get_attr":
            return fetch_attr(self.split, node.target)
        i = self.placeholders.index(node)
        if i < len(inputs):
            return inputs[i]
        return node.args[0] if node.args else None
