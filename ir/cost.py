"""Analytic cost model: per-node FLOPs and bytes as sympy expressions of the batch symbol.

Each compute node of a traced graph is run on the meta device (no memory, no arithmetic) inside
``torch.utils.flop_counter.FlopCounterMode``, forward and then backward, at two batch sizes. Costs
are affine in the batch for every layer kind the zoo has (convolutions, matmuls, attention,
normalisation, elementwise), so two points give the exact expression ``a*B + c``.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import cost, meta
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 4)))
    >>> cost.annotate(gm, (torch.randn(2, 8),))
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> meta.get_cost(node).fwd_flops
    64*B
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from tidal.ir import meta
from tidal.ir.device_profile import layer_signature, node_signature, node_signatures
from tidal.ir.meta import BATCH
from tidal.ir.node_runner import COMPUTE_OPS, flat_tensors, map_tensors, op_name, run_isolated


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _to_meta_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(gm, memo)


def _rebatch(value: Any, batch: int, batch_dim: int) -> Any:
    """A meta tensor like ``value`` with dimension ``batch_dim`` set to ``batch``."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    if value.dim() > batch_dim:
        shape[batch_dim] = batch
    return torch.empty(shape, dtype=value.dtype, device="meta")


def _describe_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad)
    return repr(v)


def materialize(v: Any) -> Any:
    """A real tensor shaped like ``v`` (random floats, zero integers), for running a node that
    fake tensors cannot; other values as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.is_floating_point():
        return torch.randn(v.shape, dtype=v.dtype)
    return torch.zeros(v.shape, dtype=v.dtype)


def _real_leaf(v: Any) -> Any:
    """``materialize`` for one value of the meta run, where a ``x.device`` read is the meta
    device: a real run moving a tensor there (``x.to(y.device)``) must stay on the CPU."""
    if isinstance(v, torch.device) and v.type == "meta":
        return torch.device("cpu")
    return materialize(v)


def _replay_leaf(leaf: tuple) -> Any:
    if leaf[0] == "T":
        return torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta")
    return leaf[1]


class _MetaCostInterpreter(fx.Interpreter):
    """Runs a meta-device graph node by node, counting each node's forward and backward FLOPs.

    Nodes with the same target (module configuration, function or method) and input shapes
    (the repeated blocks of ResNets and transformers) are counted once and replayed from
    ``memo``.
    """

    def __init__(self, gm: fx.GraphModule, memo: dict, real_gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.real_gm = real_gm
        self.samples: dict[str, tuple[int, int, int]] = {}
        self.outputs: dict[str, tuple[meta.TensorInfo, ...]] = {}
        self.memo = memo

    def _run_on_cpu(self, n: fx.Node, fwd: FlopCounterMode, bwd: FlopCounterMode) -> Any:
        """Run one node for real on random CPU inputs of the right shapes (for modules whose
        forward cannot run on the meta device); return meta tensors of the output shapes."""
        real = fx.Interpreter(self.real_gm)
        real.env = {a: tree_map(_real_leaf, self.env[a]) for a in n.all_input_nodes}
        out = run_isolated(real, n, fwd, bwd)
        return map_tensors(out, lambda v: torch.empty_like(v, device="meta"))

    def _memo_key(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flat, spec = tree_flatten((args, kwargs))
        inputs = (spec, tuple(_describe_value(v) for v in flat))
        if n.op != "call_module":
            return (n.op, n.target, inputs)
        mod = self.fetch_attr(n.target)
        state = tuple((k, tuple(t.shape), t.dtype) for k, t in mod.state_dict().items())
        return (type(mod), repr(mod), state, inputs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            out = super().run_node(n)
        else:
            key = self._memo_key(n)
            if key in self.memo:
                sample, leaves, spec = self.memo[key]
                out = tree_unflatten([_replay_leaf(leaf) for leaf in leaves], spec)
            else:
                fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
                try:
                    out = run_isolated(self, n, fwd, bwd)
                except Exception:  # e.g. a leaf module with data-dependent control flow
                    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
                    out = self._run_on_cpu(n, fwd, bwd)
                out_bytes = _tensor_bytes(flat_tensors(out))
                sample = (fwd.get_total_flops(), bwd.get_total_flops(), out_bytes)
                flat, spec = tree_flatten(out)
                leaves = [("T", tuple(v.shape), tuple(v.stride()), v.dtype)
                          if isinstance(v, torch.Tensor) else ("V", v) for v in flat]
                self.memo[key] = (sample, leaves, spec)
            self.samples[n.name] = sample
        self.outputs[n.name] = _describe(out)
        return out


def _describe(out: Any) -> tuple[meta.TensorInfo, ...]:
    return tuple(meta.TensorInfo(tuple(t.shape), t.dtype) for t in flat_tensors(out))


def _affine(b0: int, v0: int, b1: int, v1: int) -> sympy.Expr:
    slope = sympy.Rational(v1 - v0, b1 - b0)
    return sympy.nsimplify(slope * BATCH + (v0 - slope * b0))


def _owned_bytes(gm: fx.GraphModule, n: fx.Node, seen: set) -> tuple[int, int]:
    """Parameter and buffer bytes node ``n`` owns: those it uses that no earlier node did
    (``seen`` holds their ids), so a tied weight (GPT-2's ``lm_head`` and ``wte``) or a module
    called twice counts once."""
    params: list = []
    bufs: list = []
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        params, bufs = list(mod.parameters()), list(mod.buffers())
    elif n.op == "get_attr":
        for get, into in ((gm.get_parameter, params), (gm.get_buffer, bufs)):
            try:
                into.append(get(n.target))
                break
            except AttributeError:
                continue
    fresh = [[t for t in ts if id(t) not in seen] for ts in (params, bufs)]
    seen.update(id(t) for ts in fresh for t in ts)
    return _tensor_bytes(fresh[0]), _tensor_bytes(fresh[1])


def layer_ref(gm: fx.GraphModule, n: fx.Node) -> meta.LayerRef:
    """The ``LayerRef`` of a node: module path and class for ``call_module``, else node name and
    function name, each with its enclosing module scope."""
    if n.op == "call_module":
        kind = type(gm.get_submodule(n.target)).__name__
        return meta.LayerRef(path=str(n.target), kind=kind, scope=meta.module_scope(n))
    return meta.LayerRef(path=n.name, kind=op_name(n), scope=meta.module_scope(n))


def example_batch(example_inputs: Sequence[Any], batch_dim: int = 0) -> int:
    """The batch size of the example inputs: the size of ``batch_dim`` of the first tensor."""
    for v in tree_flatten(list(example_inputs))[0]:
        if isinstance(v, torch.Tensor) and v.dim() > batch_dim:
            return int(v.shape[batch_dim])
    raise ValueError("example_inputs hold no tensor with a batch dimension")


def annotate(gm: fx.GraphModule, example_inputs: Sequence[Any], batch_dim: int = 0) -> None:
    """Annotate every node of ``gm`` with its layer, output tensors and cost.

    Shapes are recorded at the example batch; costs are exact affine functions of ``BATCH``
    obtained from two meta-device runs. Nothing is computed on real data and ``gm`` itself is not
    run; its parameters are not touched.
    """
    b0 = example_batch(example_inputs, batch_dim)
    b1 = b0 + 1 if b0 > 1 else 2
    meta_gm = _to_meta_module(gm)
    runs = {}
    memo: dict = {}
    for b in (b0, b1):
        interp = _MetaCostInterpreter(meta_gm, memo, gm)
        inputs = map_tensors(tuple(example_inputs), lambda v: _rebatch(v, b, batch_dim))
        interp.run(*inputs)
        runs[b] = interp
    owned: set = set()
    for n in gm.graph.nodes:
        meta.set_tensors(n, runs[b0].outputs.get(n.name, ()))
        if n.op in COMPUTE_OPS or n.op == "get_attr":
            meta.set_layer(n, layer_ref(gm, n))
        s0 = runs[b0].samples.get(n.name)
        s1 = runs[b1].samples.get(n.name)
        pbytes, bbytes = _owned_bytes(gm, n, owned)
        if s0 is None:
            if pbytes or bbytes:
                zero = sympy.Integer(0)
                meta.set_cost(n, meta.NodeCost(zero, zero, zero, pbytes, bbytes))
            continue
        meta.set_cost(n, meta.NodeCost(
            fwd_flops=_affine(b0, s0[0], b1, s1[0]),
            bwd_flops=_affine(b0, s0[1], b1, s1[1]),
            out_bytes=_affine(b0, s0[2], b1, s1[2]),
            param_bytes=pbytes,
            buffer_bytes=bbytes,
        ))


def total_cost(gm: fx.GraphModule, batch: int) -> dict[str, float]:
    """Sum of the annotated costs of all nodes at a concrete batch size."""
    totals = {"fwd_flops": 0.0, "bwd_flops": 0.0, "out_bytes": 0.0, "param_bytes": 0.0,
              "buffer_bytes": 0.0}
    for n in gm.graph.nodes:
        c = meta.get_cost(n)
        if c is not None:
            for k, v in c.at(batch).items():
                totals[k] += v
    return totals


def node_time_us(gm: fx.GraphModule, n: fx.Node, batch: int, cluster) -> tuple[float, float]:
    """Forward and backward time of node ``n`` at per-GPU ``batch`` on ``cluster``'s device.

    From ``cluster.profile`` when it has the node (a measured profile keyed by
    ``tidal.ir.device_profile.node_signature``, or a DeepPool profile keyed by
    ``tidal.ir.device_profile.layer_signature`` for module calls), else the annotated FLOPs at
    ``cluster.peak_tflops``. Nodes with no cost annotation take no time. For every node of a
    graph at once, use :func:`node_times_us`.
    """
    signature = None
    if cluster.profile is not None and n.op in COMPUTE_OPS:
        signature = node_signature(gm, n, batch)
    return _time_us(gm, n, batch, cluster, signature)


def node_times_us(gm: fx.GraphModule, batch: int, cluster) -> dict[str, tuple[float, float]]:
    """:func:`node_time_us` of every node, by node name, analysing the graph once."""
    signatures: dict[str, str] = {}
    if cluster.profile is not None:
        signatures = node_signatures(gm, batch)
    return {n.name: _time_us(gm, n, batch, cluster, signatures.get(n.name))
            for n in gm.graph.nodes}


def _time_us(gm: fx.GraphModule, n: fx.Node, batch: int, cluster,
             signature: str | None) -> tuple[float, float]:
    profile = cluster.profile
    if profile is not None and signature is not None:
        hit = profile.lookup(signature)
        if hit is None and n.op == "call_module" and n.all_input_nodes:
            shapes = meta.get_tensors(n.all_input_nodes[0])
            if shapes:
                key = layer_signature(gm.get_submodule(n.target), shapes[0].shape[1:], batch)
                hit = profile.lookup(key) if key else None
        if hit is not None:
            return hit.fwd_us, hit.bwd_us
    c = meta.get_cost(n)
    if c is None:
        return 0.0, 0.0
    v = c.at(batch)
    return cluster.compute_us(v["fwd_flops"]), cluster.compute_us(v["bwd_flops"])
