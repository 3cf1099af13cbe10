"""Capture a model through ``torch.export`` (non-strict) as a graph the passes can use.

``torch.export.export(model, args, kwargs, strict=False)`` runs the forward in Python on fake
tensors, so it takes what ``torch.fx``'s symbolic tracer cannot (Hugging Face models of every
transformers version, data-dependent Python on shapes). Its graph is rebuilt into the form
tidal's passes read from fx-traced graphs:

- each call of a *leaf* module (a ``torch.nn`` module such as ``nn.Linear``, ``nn.Embedding``,
  ``nn.LayerNorm``, ``nn.Dropout``, activations, as ``torch.fx`` keeps them whole, and the
  user's ``leaf_modules``) is one ``call_module`` node on the model's own submodule, its
  ``target`` the qualified path (the export's ``preserve_module_call_signature`` gives each
  call's arguments and results);
- everything else stays the export's ``call_function`` nodes on aten operators
  (``torch.ops.aten.matmul``, ``aten.softmax``, ``aten.scaled_dot_product_attention``, ...);
  ``node.meta["nn_module_stack"]`` keeps the module each node came from;
- parameters, buffers and tensor constants are ``get_attr`` nodes reading the model's own
  objects by qualified name (not copies); a buffer written in place (``self.count.add_(1)``,
  BatchNorm's ``num_batches_tracked``) is written in the model's buffer, as in eager;
- placeholders are the model's input names (keyword inputs bind by name); the output is the
  model's, a ``ModelOutput`` given as a plain dict of its fields (what transformers.utils.fx
  graphs returned).

A forward that takes ``use_cache`` and is not given it is captured with ``use_cache=False``
(no key/value cache in the outputs of a training capture); the graph's trace notes say so.

Inside ``with reusing_exports(cache):`` a capture of a model that exports alike an earlier one
(``export_key``: the same module tree, attributes and config, parameter shapes and dtypes,
input signature, leaves and global modes; e.g. a fresh copy of the same architecture) rebuilds
its graph from the export ``cache`` kept, on its own parameters, instead of exporting again.

Example:
    >>> import torch
    >>> from tidal.ir.export_capture import export_trace
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return {"y": torch.relu(self.lin(x)) * x.shape[0]}
    >>> model = Net()
    >>> x = torch.randn(2, 4)
    >>> gm = export_trace(model, {"x": x})
    >>> [(n.op, str(n.target)) for n in gm.graph.nodes][:3]
    [('placeholder', 'x'), ('call_module', 'lin'), ('call_function', 'aten.relu.default')]
    >>> torch.equal(gm(x)["y"], model(x)["y"]), gm.lin.weight is model.lin.weight
    (True, True)
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import enum
import functools
import hashlib
import inspect
import operator
import os
import traceback
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from tidal.ir import meta
from tidal.ir.errors import TraceError
from tidal.ir.trace_lock import tracing

LeafSpec = Union[str, type]
"""A leaf module given by qualified path (``"layer1.0"``) or by class (``Bottleneck``)."""

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential,
               torch.nn.ParameterList, torch.nn.ParameterDict)
"""``torch.nn`` modules that hold others and are not leaves (fx traces through Sequential)."""

_DROPPED_OPS = frozenset({"_assert_tensor_metadata", "_assert_scalar", "_assert_async"})
"""Aten checks the export records on its own (dtype/shape asserts); they compute nothing."""

_KEPT_META = ("nn_module_stack", "stack_trace")
"""The node meta kept from the export (its fake values are not: fx graphs have none)."""

_NO_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
"""How the export spells a ``with torch.no_grad():`` region (inlined, ``_Rebuilder``)."""

NAME = "torch.export (non-strict)"
"""How the trace notes name this capture path."""

_TORCH_DIR = os.path.dirname(torch.__file__)
_TIDAL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_leaf(leaf_modules: Iterable[LeafSpec]) -> Callable[[torch.nn.Module, str], bool]:
    """``(module, qualified name) -> bool``: whether ``leaf_modules`` (paths or classes) names
    it."""
    leaves = tuple(leaf_modules)
    paths = frozenset(x for x in leaves if isinstance(x, str))
    types_ = tuple(x for x in leaves if isinstance(x, type))
    return lambda m, qualname: qualname in paths or bool(types_) and isinstance(m, types_)


def is_torch_leaf(m: torch.nn.Module) -> bool:
    """Whether ``torch.fx`` keeps ``m`` whole: a ``torch.nn`` (or ``torch.ao.nn``) module that
    is not a container."""
    home = type(m).__module__
    return (home.startswith("torch.nn.") or home.startswith("torch.ao.nn.")) and \
        not isinstance(m, _CONTAINERS)


def leaf_paths(model: torch.nn.Module, leaf_modules: Iterable[LeafSpec] = ()) -> tuple[str, ...]:
    """Qualified paths of the outermost leaf modules of ``model`` (the root excluded): torch's
    own modules and those ``leaf_modules`` names.

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    >>> leaf_paths(m)
    ('0', '1.0')
    >>> leaf_paths(m, ["1"])
    ('0', '1')
    """
    user = user_leaf(leaf_modules)
    out: list[str] = []
    for path, m in model.named_modules(remove_duplicate=False):  # each name of a shared one
        if path and (user(m, path) or is_torch_leaf(m)) and \
                not any(path.startswith(p + ".") for p in out):
            out.append(path)
    return tuple(out)


# --- inputs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Inputs:
    """What is exported: positional ``args`` and keyword ``kwargs``, the forward parameter name
    of each flat user input in order, the names tidal added (not graph inputs), and notes."""

    args: tuple
    kwargs: dict
    names: tuple[str, ...]
    added: frozenset
    notes: tuple[str, ...]
    params: frozenset          # the forward's named parameters

    def batched(self) -> tuple[tuple, dict, dict]:
        """``(args, kwargs, dynamic_shapes)`` for the export: the dimensions ``_free_dims``
        names (the batch; every dimension of token ids and masks) are left to the export to
        keep symbolic (``Dim.AUTO``: where the model fixes one, it stays fixed), so that the
        graph runs at other batch sizes and sequence lengths; at batch 1 (which the export
        would specialise) the inputs whose dimension 0 holds the batch are exported at 2."""
        named = dict(zip(self.names, list(self.args) + [self.kwargs[k] for k in self.kwargs]))
        tensors = [v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            return self.args, self.kwargs, {}
        batch = tensors[0].shape[0]

        def grow(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch == 1:
                return v.expand(2, *v.shape[1:]).clone()
            return v

        dims = {name: {i: torch.export.Dim.AUTO for i in _free_dims(v)}
                if isinstance(v, torch.Tensor) and v.dim() > 0 else None
                for name, v in named.items()}
        return (tuple(grow(v) for v in self.args), {k: grow(v) for k, v in self.kwargs.items()},
                dims)

    @contextlib.contextmanager
    def named_forward(self, model: torch.nn.Module):
        """Where an input goes to the forward's ``**kwargs``, the model's forward seen with
        one named parameter per input for the duration (torch's ``dynamic_shapes`` cannot
        name an entry of ``**kwargs``), its own forward put back after."""
        if all(name in self.params for name in self.names):
            yield
            return
        saved = model.__dict__.get("forward")
        forward = type(model).forward

        def named(*args: Any, **kwargs: Any) -> Any:
            return forward(model, *args, **kwargs)

        named.__signature__ = inspect.Signature(   # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in self.names])
        model.forward = named
        try:
            yield
        finally:
            del model.forward
            if saved is not None:
                model.forward = saved


def _free_dims(value: torch.Tensor) -> range:
    """The dimensions of an input left symbolic: every one of an integer or boolean tensor
    (token ids, masks, positions: batch and sequence length vary from call to call), only the
    batch of a floating one (an image's height and width would make the export reason about
    every window and padding of a vision model symbolically: minutes for a tiny Swin)."""
    floating = value.is_floating_point() or value.is_complex()
    return range(1 if floating else value.dim())


def _export_inputs(model: torch.nn.Module,
                   example_inputs: Union[Sequence[Any], Mapping[str, Any]]) -> _Inputs:
    params = inspect.signature(model.forward).parameters
    positional = [p.name for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if isinstance(example_inputs, Mapping):
        args: tuple = ()
        kwargs = {k: v for k, v in example_inputs.items() if v is not None}
        named = list(kwargs.items())
    else:
        args, kwargs = tuple(example_inputs), {}
        if len(args) > len(positional):
            raise TraceError(f"cannot export {type(model).__name__}: {len(args)} positional "
                             f"inputs for a forward taking {len(positional)}",
                             module_type=type(model).__name__)
        named = list(zip(positional, args))
    notes, added = [], set()
    if "use_cache" in params and "use_cache" not in kwargs and \
            "use_cache" not in positional[:len(args)]:
        kwargs["use_cache"] = False
        added.add("use_cache")
        notes.append("captured with use_cache=False (no key/value cache in the outputs)")
    names = []
    for name, value in named:
        count = len(tree_flatten(value)[0])
        if count > 1 or (count == 0 and not isinstance(example_inputs, Mapping)):
            raise TraceError(f"cannot export {type(model).__name__}: input {name!r} is a "
                             f"{type(value).__name__} of {count} values; give tensors or "
                             f"plain values", module_type=type(model).__name__)
        if count:
            names.append(name)
    names += sorted(added)
    return _Inputs(args, kwargs, tuple(names), frozenset(added), tuple(notes),
                   frozenset(params))


# --- errors ------------------------------------------------------------------------------------

def _frames(exc: BaseException) -> list[tuple[Any, int]]:
    """``(frame, line number)`` of every traceback entry of ``exc`` and the exceptions it was
    raised from, outermost first, the deepest chain last."""
    chain, seen = [], set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    out: list[tuple[Any, int]] = []
    for e in reversed(chain):
        out += list(traceback.walk_tb(e.__traceback__))
    return out


def _is_user_file(filename: str) -> bool:
    f = os.path.abspath(filename)
    return not (f.startswith(_TORCH_DIR) or f.startswith(_TIDAL_DIR + os.sep + "ir")
                or "<" in filename)


def export_error(model: torch.nn.Module, exc: BaseException, what: str = NAME) -> TraceError:
    """A ``TraceError`` for an export of ``model`` that failed with ``exc``: the innermost
    module of ``model`` whose forward was running, and the innermost source line outside
    torch and tidal."""
    modules = {id(m): (path, type(m).__name__) for path, m in model.named_modules()}
    path, kind, where, code = "", type(model).__name__, "", ""
    found_module = False
    for frame, lineno in reversed(_frames(exc)):
        owner = frame.f_locals.get("self")
        if not found_module and id(owner) in modules:
            path, kind = modules[id(owner)]
            found_module = True
        if not where and _is_user_file(frame.f_code.co_filename):
            where = f"{frame.f_code.co_filename}:{lineno}"
            line = traceback.FrameSummary(frame.f_code.co_filename, lineno,
                                          frame.f_code.co_name).line
            code = f": `{line.strip()}`" if line else ""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    place = f"module '{path}' ({kind})" if path else f"the top-level forward of {kind}"
    return TraceError(
        f"cannot capture {type(model).__name__} with {what}: {place}"
        f"{' at ' + where if where else ''}{code}: {type(exc).__name__}: {reason}",
        module_path=path, module_type=kind, location=where)


# --- rebuilding the graph ----------------------------------------------------------------------

@dataclass
class _Call:
    """One leaf-module call of the export: the submodule path, its signature, and the export's
    nodes that compute it (in graph order)."""

    path: str
    signature: Any
    nodes: list


def _call_key(key: str, path: str) -> str:
    """``path`` with the call index of an ``nn_module_stack`` key (``L__self__lin@1``:
    ``lin@1``), as ``module_call_graph`` names each call."""
    head, _, index = key.rpartition("@")
    return f"{path}@{index}" if head and index.isdigit() else path


def _leaf_calls(ep: Any, leaves: Sequence[str]) -> dict[str, _Call]:
    """Each leaf-module call of ``ep`` by node name of every node inside it."""
    signatures = {e.fqn: e.signature for e in ep.module_call_graph if e.signature is not None}
    leaf_set = set(leaves)
    calls: dict[str, _Call] = {}
    owner: dict[str, _Call] = {}
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack") or {}
        for key, (path, _) in stack.items():
            if path in leaf_set:
                fqn = _call_key(key, path)
                if fqn in signatures:
                    call = calls.setdefault(fqn, _Call(path, signatures[fqn], []))
                    call.nodes.append(n)
                    owner[n.name] = call
                break
    return {name: c for name, c in owner.items() if _collapsible(c)}


def _collapsible(call: _Call) -> bool:
    """Whether ``call`` can become one ``call_module`` node: its inputs are graph values or
    constants, and outside it only its results are read."""
    sig = call.signature
    kinds = {type(a).__name__ for a in list(sig.inputs) + list(sig.outputs)}
    if not kinds <= {"TensorArgument", "ConstantArgument"}:
        return False
    inside = set(call.nodes)
    results = {a.name for a in sig.outputs if type(a).__name__ == "TensorArgument"}
    return all(u in inside or n.name in results for n in call.nodes for u in n.users)


def _children(spec: Any) -> list:
    kids = getattr(spec, "children", None)
    return list(kids()) if callable(kids) else list(spec.children_specs)


def _structure(spec: Any, leaves: list) -> Any:
    """The export's output tree ``spec`` over ``leaves`` as fx can hold it: a dict for a
    ``ModelOutput`` or dict, a tuple, namedtuple or list for those."""
    if spec.is_leaf():
        return leaves.pop(0)
    kids = [_structure(s, leaves) for s in _children(spec)]
    if isinstance(spec.type, type) and issubclass(spec.type, list):
        return kids
    if isinstance(spec.type, type) and issubclass(spec.type, tuple):
        return spec.type(*kids) if hasattr(spec.type, "_fields") else tuple(kids)
    keys = spec.context
    if isinstance(keys, (list, tuple)) and len(keys) == len(kids):
        return dict(zip(keys, kids))
    raise TraceError(f"cannot rebuild an output of type {getattr(spec.type, '__name__', spec)} "
                     f"from the export")


def _resolve(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class _Deferred:
    """A size computation (``aten.sym_size.int(x, 0)``, arithmetic on it) not yet emitted:
    emitted where first read, as fx puts ``x.size(0)`` beside its use, so that graph splitters
    that keep the node order (``split_module(keep_original_order=True)``) do not see a size
    of the inputs at the top of the graph as the start of a later partition."""

    node: fx.Node


def _is_size(n: fx.Node) -> bool:
    """Whether ``n`` computes a size (a symbolic int, float or bool) without side effects."""
    if n.op != "call_function" or \
            not isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    schema = getattr(n.target, "_schema", None)
    return schema is None or not schema.is_mutable


def _own(obj: Any) -> Any:
    """A copy of a tensor or graph module of the export, for the rebuilt graph to hold: graphs
    rebuilt from one export (:class:`ExportCache`) share nothing a pass could change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, fx.GraphModule):
        return copy.deepcopy(obj)
    return obj


class _Rebuilder:
    """Builds the tidal graph from an ``ExportedProgram`` of ``model``."""

    def __init__(self, model: torch.nn.Module, ep: Any, leaves: Sequence[str],
                 inputs: _Inputs):
        self.model, self.ep, self.inputs = model, ep, inputs
        self.graph = fx.Graph()
        self.env: dict[str, Any] = {}
        self.attrs: dict[str, Any] = {}        # get_attr / call_module target -> object
        self.state: dict[str, str] = {}        # lifted placeholder -> qualified target
        self.calls = _leaf_calls(ep, leaves)
        self.canonical = {id(m): path for path, m in model.named_modules()}
        self.emitted: set[int] = set()

    def attr(self, target: str) -> fx.Node:
        """A ``get_attr`` node reading ``target`` (the model's own object by qualified name,
        else a copy of the export's lifted constant or subgraph)."""
        if target not in self.attrs:
            try:
                self.attrs[target] = _resolve(self.model, target)
            except AttributeError:
                consts = getattr(self.ep, "constants", {})
                self.attrs[target] = _own(consts[target] if target in consts else
                                          _resolve(self.ep.graph_module, target))
        return self.graph.get_attr(target)

    def value(self, name: str) -> Any:
        """The rebuilt value of the export's node ``name``; a parameter, buffer or constant,
        or a size (deferred), is emitted where it is first read."""
        if name in self.state:
            key = f"attr:{self.state[name]}"
            if key not in self.env:
                self.env[key] = self.attr(self.state[name])
            return self.env[key]
        value = self.env[name]
        if isinstance(value, _Deferred):
            value = self.env[name] = self.copy(value.node, lambda a: self.value(a.name))
        return value

    def build(self) -> fx.GraphModule:
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs}
        names = iter(self.inputs.names)
        for n in self.ep.graph.nodes:
            if n.op == "placeholder":
                self.placeholder(n, specs[n.name], names)
            elif n.op == "get_attr":
                self.env[n.name] = self.attr(n.target)
            elif n.op == "output":
                self.output(n)
            elif n.name in self.calls:
                self.leaf_node(n)
            elif getattr(n.target, "_opname", None) in _DROPPED_OPS and not n.users:
                continue
            elif n.target is _NO_GRAD_REGION and n.args[0] is False:
                self.env[n.name] = self.inline_no_grad(n, self.ep.graph_module,
                                                       lambda a: self.value(a.name))
            elif n.target is operator.getitem and isinstance(self.env.get(n.args[0].name), tuple):
                self.env[n.name] = self.env[n.args[0].name][n.args[1]]
            elif _is_size(n):
                self.env[n.name] = _Deferred(n)
            else:
                self.env[n.name] = self.copy(n, lambda a: self.value(a.name))
        fx.GraphModule(self.attrs, self.graph)   # owns the graph for the purity check:
        self.graph.eliminate_dead_code()         # drops what only the dropped checks read
        used = {n.target for n in self.graph.nodes if n.op in ("get_attr", "call_module")}
        root = {k: v for k, v in self.attrs.items() if k in used}
        gm = fx.GraphModule(root, self.graph, type(self.model).__name__)
        gm.training = self.model.training
        return gm

    def copy(self, n: fx.Node, arg: Callable[[fx.Node], Any]) -> fx.Node:
        new = self.graph.node_copy(n, arg)
        new.meta = {k: copy.copy(n.meta[k]) for k in _KEPT_META if k in n.meta}
        return new

    def inline_no_grad(self, n: fx.Node, home: torch.nn.Module, env: dict) -> tuple:
        """A ``torch.no_grad()`` region (the export's ``wrap_with_set_grad_enabled(False,
        body, *inputs)``, ``body`` an attribute of ``home``, its arguments' values in ``env``)
        inlined on detached inputs: nothing in it records autograd, as under ``no_grad``, and
        the graph has only plain ops (torch's FLOP counter leaves grad mode off after running
        that higher-order op). Returns the region's outputs."""
        body = _resolve(home, n.args[1].target)
        inner: dict[str, Any] = {}
        for value, p in zip(n.args[2:], [x for x in body.graph.nodes if x.op == "placeholder"]):
            v = env(value) if isinstance(value, fx.Node) else value
            if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                v = self.graph.call_function(torch.ops.aten.detach.default, (v,))
            inner[p.name] = v
        for x in body.graph.nodes:
            if x.op == "output":
                return tuple(inner[a.name] if isinstance(a, fx.Node) else a for a in x.args[0])
            if x.op == "get_attr":      # a region's own region (autocast off): its body
                inner[x.name] = self.attr(self.unique(_resolve(body, x.target)))
            elif x.target is _NO_GRAD_REGION and x.args[0] is False:
                inner[x.name] = self.inline_no_grad(x, body, lambda a: inner[a.name])
            elif x.target is operator.getitem and isinstance(inner.get(x.args[0].name), tuple):
                inner[x.name] = inner[x.args[0].name][x.args[1]]
            elif x.op != "placeholder":
                inner[x.name] = self.copy(x, lambda a: inner[a.name])
        raise AssertionError("a graph without output")

    def unique(self, obj: Any) -> str:
        """A fresh attribute name of the graph module for ``obj``."""
        name = f"_export_region_{len(self.attrs)}"
        self.attrs[name] = _own(obj)
        return name

    def placeholder(self, n: fx.Node, spec: Any, names: Iterable[str]) -> None:
        if spec.kind == InputKind.USER_INPUT:
            name = next(names)
            if name in self.inputs.added:
                return
            default = self.inputs.kwargs.get(name)
            value = default if not isinstance(default, torch.Tensor) else None
            new = self.graph.placeholder(name, default_value=value) if value is not None \
                else self.graph.placeholder(name)
            meta.set_input_name(new, name)
            self.env[n.name] = new
        else:
            self.state[n.name] = spec.target

    def leaf_node(self, n: fx.Node) -> None:
        """Skip a node inside a leaf call; at the call's last node, emit the call."""
        call = self.calls[n.name]
        if n is not call.nodes[-1]:
            return
        sig = call.signature
        flat = [self.value(a.name) if type(a).__name__ == "TensorArgument" else a.value
                for a in sig.inputs]
        args, kwargs = tree_unflatten(flat, sig.in_spec)
        module = self.model.get_submodule(call.path)
        target = self.canonical[id(module)]      # a module under several names: its first,
        node = self.graph.call_module(target, tuple(args), dict(kwargs))  # as fx names it
        self.attrs[target] = module
        stack = n.meta.get("nn_module_stack") or {}
        keys = list(stack)
        upto = next(i for i, k in enumerate(keys) if stack[k][0] == call.path)
        node.meta["nn_module_stack"] = {k: stack[k] for k in keys[:upto]}
        node.meta["nn_module_stack"][keys[upto]] = (target, stack[keys[upto]][1])
        if "stack_trace" in n.meta:
            node.meta["stack_trace"] = n.meta["stack_trace"]
        inside = {x.name for x in call.nodes}
        if sig.out_spec.is_leaf():
            (out,) = sig.outputs
            if getattr(out, "name", None) in inside:
                self.env[out.name] = node
            return
        dummy = tree_unflatten(list(range(len(sig.outputs))), sig.out_spec)
        for path, index in tree_flatten_with_path(dummy)[0]:
            out = sig.outputs[index]
            if getattr(out, "name", None) not in inside:
                continue
            value = node
            for key in path:
                if hasattr(key, "idx"):
                    value = self.graph.call_function(operator.getitem, (value, key.idx))
                elif hasattr(key, "key"):
                    value = self.graph.call_function(operator.getitem, (value, key.key))
                else:
                    value = self.graph.call_function(getattr, (value, key.name))
            self.env[out.name] = value

    def output(self, n: fx.Node) -> None:
        """The user outputs in the model's structure; lifted buffer or input mutations
        written back in place (an export that functionalises them)."""
        outs = list(n.args[0])
        user = []
        for spec, value in zip(self.ep.graph_signature.output_specs, outs):
            mapped = self.value(value.name) if isinstance(value, fx.Node) else value
            if spec.kind == OutputKind.USER_OUTPUT:
                user.append(mapped)
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                self.graph.call_function(torch.ops.aten.copy_.default,
                                         (self.attr(spec.target), mapped))
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                target = next(v for k, v in self.env.items() if getattr(v, "op", "") ==
                              "placeholder" and v.target == spec.target)
                self.graph.call_function(torch.ops.aten.copy_.default, (target, mapped))
            else:
                raise TraceError(f"cannot rebuild the export's {spec.kind.name} output "
                                 f"{spec.target or value}")
        self.graph.output(_structure(self.ep.call_spec.out_spec, user))


# --- reusing an export ------------------------------------------------------------------------

class _Unkeyable(Exception):
    """A value the reuse key cannot describe exactly (the export is then not reused)."""


_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type,
            enum.Enum, torch.dtype, torch.device, torch.layout, torch.memory_format)
"""Values that stand for themselves in a key (compared by value, or by identity for types)."""

_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
         types.WrapperDescriptorType)
"""Code objects, compared by identity (a patched or re-created function is another one)."""

_CONTAINERS_OF_VALUES = (list, tuple, dict, set, frozenset)


class _Describer:
    """Hashable descriptions of everything a non-strict export of ``model`` reads: modules by
    their first qualified name, parameters and buffers by name and metadata (the export runs
    on fake copies of them), any other tensor by metadata and value (read for real)."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {id(m): path for path, m in model.named_modules()}
        self.state: dict[int, str] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            self.state.setdefault(id(t), name)
        self.memo: dict[int, Any] = {}
        self.active: set[int] = set()

    def model(self, model: torch.nn.Module) -> tuple:
        """Each module under each of its names: its class, its class's ``forward`` and all
        its attributes (``training``, configs, hooks, parameters and buffers, children)."""
        return tuple((path, type(m), getattr(type(m), "forward", None), self.value(vars(m)))
                     for path, m in model.named_modules(remove_duplicate=False))

    def tensor(self, t: torch.Tensor) -> tuple:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise _Unkeyable(f"a {type(t).__name__} of layout {t.layout}")
        shape = (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad, t.stride(),
                 t.storage_offset())
        if id(t) in self.state:
            return ("state", self.state[id(t)]) + shape
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if t.device.type != "meta" else b""
        return ("tensor", hashlib.sha256(data).hexdigest()) + shape

    def value(self, v: Any) -> Any:
        """``v`` as a hashable description; ``_Unkeyable`` for what cannot be described."""
        if isinstance(v, _SCALARS):
            return (type(v), v)
        if isinstance(v, _CODE):
            return ("code", v)
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, torch.nn.Module):
            if id(v) not in self.modules:
                raise _Unkeyable(f"a {type(v).__name__} outside the model")
            return ("module", self.modules[id(v)])
        if id(v) in self.memo:
            return self.memo[id(v)][1]
        if id(v) in self.active:
            raise _Unkeyable(f"a {type(v).__name__} that holds itself")
        self.active.add(id(v))
        try:
            out = (type(v), self.composite(v))
        finally:
            self.active.discard(id(v))
        self.memo[id(v)] = (v, out)     # v kept alive: its id is not reused meanwhile
        return out

    def composite(self, v: Any) -> Any:
        if isinstance(v, dict):
            items = tuple((self.value(k), self.value(x)) for k, x in v.items())
        elif isinstance(v, (set, frozenset)):
            items = frozenset(self.value(x) for x in v)
        elif isinstance(v, (list, tuple)):
            items = tuple(self.value(x) for x in v)
        elif isinstance(v, types.MethodType):
            return self.value(v.__func__), self.value(v.__self__)
        elif isinstance(v, weakref.ref):     # nn.LSTM's _flat_weight_refs
            return self.value(v())
        elif isinstance(v, functools.partial):
            return self.value(v.func), self.value(v.args), self.value(v.keywords)
        elif not hasattr(v, "__dict__") or \
                any("__slots__" in vars(c) for c in type(v).__mro__[:-1]):
            raise _Unkeyable(f"a {type(v).__name__} (no plain attributes to compare)")
        else:
            return self.value(vars(v))
        extra = vars(v) if isinstance(v, _CONTAINERS_OF_VALUES) and hasattr(v, "__dict__") \
            else {}
        return items, self.value(extra) if extra else ()


def _torch_modes() -> tuple:
    """The global modes an export records: grad and inference mode, the default dtype,
    autocast per device type, deterministic algorithms."""
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), autocast, torch.are_deterministic_algorithms_enabled())


def _key(model: torch.nn.Module, inputs: _Inputs, leaves: Sequence[str]) -> Optional[tuple]:
    """What an export of ``model`` on ``inputs`` depends on (None: something in it cannot be
    described exactly, so the export is not reused). Input tensors by metadata and aliasing:
    the export sees only fake copies of them."""
    describe = _Describer(model)
    first: dict[int, int] = {}

    def arg(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("input", first.setdefault(id(v), len(first))) + describe.tensor(v)[2:]
        return describe.value(v)

    try:
        return (describe.model(model), tuple(arg(v) for v in inputs.args),
                tuple((k, arg(v)) for k, v in inputs.kwargs.items()), inputs.names,
                tuple(sorted(inputs.added)), tuple(leaves), _torch_modes())
    except Exception:  # noqa: BLE001 - _Unkeyable, or a tensor whose bytes cannot be read:
        return None    # such a model is exported every time


def export_key(model: torch.nn.Module,
               example_inputs: Union[Sequence[Any], Mapping[str, Any]],
               leaf_modules: Iterable[LeafSpec] = ()) -> Optional[tuple]:
    """The key under which :class:`ExportCache` keeps the export of ``model`` on
    ``example_inputs``: the module tree (every module's class, its ``forward``, its
    attributes: ``training``, configs, hooks), the parameters' and buffers' names, aliasing,
    shapes, dtypes and ``requires_grad``, the values of any other tensor the model holds, the
    inputs' names, shapes, strides and dtypes (not their values: the export runs on fake
    copies), the leaf modules and torch's global modes. ``None`` where something cannot be
    described exactly (such a model is exported every time).

    >>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    >>> x = torch.randn(3, 4)
    >>> export_key(a, (x,)) == export_key(b, (x,))       # other values, the same export
    True
    >>> export_key(a, (x,)) == export_key(a.eval(), (x,))            # training differs
    False
    >>> export_key(a, (x,)) == export_key(a, (x.double(),))           # so does the dtype
    False
    """
    return _key(model, _export_inputs(model, example_inputs), leaf_paths(model, leaf_modules))


class ExportCache:
    """Exports kept by :func:`export_key`, for :func:`reusing_exports`: a capture of a model
    that exports alike (a fresh copy of the same architecture and config, on inputs of the same
    shapes) rebuilds the graph from the stored ``ExportedProgram`` on its own model (a rebuild
    reads the export and copies what the graph keeps of it, so the stored one never changes).
    ``hits`` and ``misses`` count the captures that reused or stored one. The stored exports
    hold the parameters of the models they were made from (never read again).

    What the key cannot see must not change while a cache is in use: the code of the model's
    classes and of the functions they call (a replaced ``forward`` of a class is seen), class
    attributes, global registries (transformers' attention functions, torch's global module
    hooks) and global flags other than grad and inference mode, the default dtype, autocast
    and deterministic algorithms.
    """

    def __init__(self) -> None:
        self.programs: dict[tuple, Any] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> Any:
        """The export stored under ``key`` (counted a hit), or None."""
        ep = self.programs.get(key)
        self.hits += ep is not None
        return ep

    def put(self, key: tuple, ep: Any) -> None:
        """Keep ``ep`` under ``key`` (counted a miss: an export was made)."""
        self.programs[key] = ep
        self.misses += 1


_REUSE: contextvars.ContextVar = contextvars.ContextVar("tidal_export_reuse",
                                                       default=(None, False))
"""``(cache, reuse)`` of the innermost :func:`reusing_exports` (``(None, False)``: outside)."""


@contextlib.contextmanager
def reusing_exports(cache: Optional[ExportCache] = None, reuse: bool = True):
    """Within the block, :func:`export_trace` (and so ``tidal.compile`` of a model captured
    through ``torch.export``) reuses the exports kept in ``cache`` (a new one if not given) for
    models that export alike (:func:`export_key`), and keeps there those it makes. With
    ``reuse=False`` every capture exports (and keeps its export, for later blocks to reuse).
    Yields the cache.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    >>> x = torch.randn(3, 4)
    >>> with reusing_exports() as cache:
    ...     first = export_trace(model, (x,))
    ...     again = export_trace(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()), (x,))
    >>> cache.misses, cache.hits
    (1, 1)
    """
    cache = ExportCache() if cache is None else cache
    token = _REUSE.set((cache, reuse))
    try:
        yield cache
    finally:
        _REUSE.reset(token)


def _export(model: torch.nn.Module, inputs: _Inputs, leaves: Sequence[str]) -> Any:
    """The ``ExportedProgram`` of ``model`` on ``inputs``, its ``leaves`` calls preserved;
    ``TraceError`` naming the module and source line when the export fails."""
    args, kwargs, dynamic = inputs.batched()
    try:
        with inputs.named_forward(model):
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic or None,
                                       strict=False, preserve_module_call_signature=leaves)
    except Exception as e:  # noqa: BLE001 - reported with the module and line at fault
        raise export_error(model, e) from e


def export_trace(model: torch.nn.Module,
                 example_inputs: Union[Sequence[Any], Mapping[str, Any]],
                 leaf_modules: Iterable[LeafSpec] = ()) -> fx.GraphModule:
    """``model``'s forward captured with ``torch.export.export(..., strict=False)`` and rebuilt
    as described in this module's docstring. ``example_inputs``: a dict of keyword inputs or a
    tuple of positional inputs. Raises ``TraceError`` naming the module and source line when
    the export fails."""
    with tracing():     # torch.export patches torch.nn.Module process-wide (ir.trace_lock)
        inputs = _export_inputs(model, example_inputs)
        leaves = leaf_paths(model, leaf_modules)
        cache, reuse = _REUSE.get()
        key = _key(model, inputs, leaves) if cache is not None else None
        ep = cache.get(key) if key is not None and reuse else None
        if ep is None:
            ep = _export(model, inputs, leaves)
            if key is not None:
                cache.put(key, ep)
        gm = _Rebuilder(model, ep, leaves, inputs).build()
    meta.set_trace_notes(gm, (f"traced with {NAME}",) + inputs.notes)
    return gm
