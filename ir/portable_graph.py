"""A graph module that pickles as its nodes are: :class:`PortableGraph`.

``pickle`` of an ``fx.GraphModule`` re-traces its generated code on load, which loses what the
code does not show (the ``tidal::group_boundary`` markers) and fails on graphs whose code only
runs with concrete values (Hugging Face graphs slicing by a shape). A ``PortableGraph`` keeps
the module tree and every node's op, name, target (operator overloads by name) and arguments;
:meth:`PortableGraph.build` gives back a graph module with the same nodes.

Example:
    >>> import pickle, torch, torch.fx as fx
    >>> from tidal.ir.portable_graph import PortableGraph
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> back = pickle.loads(pickle.dumps(PortableGraph.of(gm))).build()
    >>> [n.op for n in back.graph.nodes] == [n.op for n in gm.graph.nodes]
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class _Ref:
    """A node argument, by the node's name."""

    name: str


@dataclass(frozen=True)
class _Op:
    """An operator overload (``torch.ops.<namespace>.<name>.<overload>``), by name."""

    namespace: str
    name: str
    overload: str

    def resolve(self) -> Any:
        packet = getattr(getattr(torch.ops, self.namespace), self.name)
        return getattr(packet, self.overload) if self.overload else packet


def _portable_target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _Op(target.namespace, target._schema.name.split("::")[-1], target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _Op(target._qualified_op_name.split("::")[0],
                   target._qualified_op_name.split("::")[1], "")
    return target


@dataclass(frozen=True)
class PortableGraph:
    """A graph module as its module tree and its nodes, each node's target and arguments as
    they are (operator overloads by name): it pickles, and :meth:`build` gives back a graph
    module with the same nodes."""

    root: torch.nn.Module
    nodes: tuple[tuple[str, str, Any, Any, Any], ...]
    codegen: Any

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "PortableGraph":
        root = torch.nn.Module()
        root._modules = dict(gm._modules)
        root._parameters = dict(gm._parameters)
        root._buffers = dict(gm._buffers)
        for n in gm.graph.nodes:
            if n.op == "get_attr" and "." not in n.target and not hasattr(root, n.target):
                setattr(root, n.target, getattr(gm, n.target))
        ref = (lambda n: _Ref(n.name))
        nodes = tuple((n.op, n.name, _portable_target(n.target), fx.node.map_arg(n.args, ref),
                       fx.node.map_arg(n.kwargs, ref)) for n in gm.graph.nodes)
        return cls(root, nodes, gm.graph._codegen)

    def build(self) -> fx.GraphModule:
        graph = fx.Graph()
        graph._codegen = self.codegen
        env: dict[str, fx.Node] = {}

        def arg(a: Any) -> Any:
            if isinstance(a, _Ref):
                return env[a.name]
            if isinstance(a, (tuple, list)):
                return type(a)(arg(x) for x in a)
            if isinstance(a, dict):
                return {k: arg(v) for k, v in a.items()}
            if isinstance(a, slice):
                return slice(arg(a.start), arg(a.stop), arg(a.step))
            return a

        for op, name, target, args, kwargs in self.nodes:
            target = target.resolve() if isinstance(target, _Op) else target
            env[name] = graph.create_node(op, target, arg(args), arg(kwargs), name)
        return fx.GraphModule(self.root, graph)
