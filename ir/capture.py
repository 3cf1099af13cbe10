"""Capture a model as a graph: the forward with ``torch.fx`` where its symbolic tracer takes
the model, else through ``torch.export`` (non-strict, ``tidal.ir.export_capture``; Hugging Face
models go there first, whatever the transformers version), and a whole training step
(forward, loss, backward) as one aten-level graph with ``make_fx``. The graph's trace notes
(the compile report's ``trace`` row) say which path was taken.

Example:
    >>> import torch
    >>> from tidal.ir.capture import trace, capture_train_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    >>> x, y = torch.randn(2, 4), torch.tensor([0, 2])
    >>> gm = trace(model, (x,))
    >>> torch.equal(gm(x), model(x))
    True
    >>> step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
    >>> loss, grads = step.run(model, (x,), y)
    >>> sorted(grads)
    ['0.bias', '0.weight']
    >>> _, scaled = step.run(model, (x,), y, seed=2.0 ** 16)   # the gradients of 2^16 * loss
    >>> torch.equal(scaled["0.weight"], grads["0.weight"] * 2.0 ** 16)
    True
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _pytree as fx_pytree
from torch.utils._pytree import tree_leaves
from torch.fx.experimental.proxy_tensor import make_fx

from tidal.ir import meta
from tidal.ir.errors import TidalError, TraceError
from tidal.ir.export_capture import NAME as EXPORT
from tidal.ir.export_capture import LeafSpec, export_trace, user_leaf
from tidal.ir.node_runner import (alias_root, fetch_attr, is_inplace_method, op_name,
                                  written_nodes)
from tidal.ir.param_owners import trainable
from tidal.ir.trace_lock import tracing

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


class _PathTracking:
    """Tracer mixin: ``failed_at`` is ``(path, class name)`` of the innermost module being
    traced when tracing failed (None before a failure)."""

    failed_at: tuple[str, str] | None = None

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = (self.path_of_module(m), type(m).__name__)
            raise


class _Tracer(_PathTracking, fx.Tracer):
    """fx tracer that honours user leaf modules and remembers which module it was in when
    tracing failed.

    With ``proxy_buffers`` (the default) a buffer read in the forward is a ``get_attr`` proxy,
    so an update of it in place (``self.count.add_(1)``, ``self.ema.mul_(0.9).add_(x)``) is a
    node of the graph, as in eager; fx's default runs such an update once on the real buffer
    at trace time and leaves it out of the graph. A buffer write records the user's line
    (``stack_trace``), and one made under ``torch.no_grad()`` writes detached values, as the
    eager update records no autograd history in the buffer."""

    def __init__(self, leaf_modules: Iterable[LeafSpec] = (), proxy_buffers: bool = True):
        super().__init__()
        self.proxy_buffer_attributes = proxy_buffers
        self.user_leaf = user_leaf(leaf_modules)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return self.user_leaf(m, qualname) or super().is_leaf_module(m, qualname)

    def create_proxy(self, kind, target, args, kwargs, *rest, **options):
        writes = kind == "call_method" and is_inplace_method(target) and bool(args) and \
            isinstance(args[0], fx.Proxy) and alias_root(args[0].node).op == "get_attr"
        if writes and not torch.is_grad_enabled():
            args = (args[0],) + tuple(self.create_proxy("call_method", "detach", (a,), {})
                                      if isinstance(a, fx.Proxy) else a for a in args[1:])
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **options)
        if writes:
            frame = _caller_frame()
            if frame is not None:
                proxy.node.meta.setdefault("stack_trace", "".join(
                    traceback.format_list([frame])))
        return proxy


def _caller_frame() -> traceback.FrameSummary | None:
    """The innermost frame of the current stack outside torch and tidal's ``ir``: the user's
    line being traced."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_THIS_DIR) and "<" not in frame.filename:
            return frame
    return None


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and tidal's compiler: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        f = os.path.abspath(frame.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_THIS_DIR) and "<" not in frame.filename:
            return frame
    return None


def _trace_error(model: torch.nn.Module, tracer: _Tracer, exc: Exception) -> TraceError:
    path, kind = tracer.failed_at or ("", type(model).__name__)
    frame = _user_frame(exc)
    location = f"{frame.filename}:{frame.lineno}" if frame else ""
    code = f": `{frame.line.strip()}`" if frame and frame.line else ""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    where = f"module '{path}' ({kind})" if path else f"the top-level forward of {kind}"
    hint = (f"keep the module whole: tidal.compile(..., leaf_modules=['{path}'] or "
            f"leaf_modules=[{kind}])" if path else
            "make that code traceable, or wrap the model in a module whose forward calls it "
            "and pass leaf_modules=[the model's class] to keep it whole")
    return TraceError(
        f"cannot trace {type(model).__name__}: {where}"
        f"{' at ' + location if location else ''}{code}: {type(exc).__name__}: {reason}. "
        f"If this forward has data-dependent control flow or an untraceable op, {hint}.",
        module_path=path, module_type=kind, location=location,
    )


def _concrete_defaults(model: torch.nn.Module, n_positional: int, given: Iterable[str]) -> dict:
    """Forward parameters the example inputs do not supply, pinned to their defaults (so that
    ``if past_key_values is None`` traces the default path)."""
    sig = inspect.signature(model.forward)
    out = {}
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for p in params[n_positional:]:
        if p.name not in given and p.default is not inspect.Parameter.empty:
            out[p.name] = p.default
    return out


def _is_hf_model(model: torch.nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _check_leaf_paths(model: torch.nn.Module, leaf_modules: Sequence[LeafSpec]) -> None:
    """Raise ``TraceError`` naming a ``leaf_modules`` path that is not a submodule of ``model``
    (a typo would otherwise be ignored silently) or an entry that is neither a path nor a
    class."""
    paths = {name for name, _ in model.named_modules()}
    for leaf in leaf_modules:
        if isinstance(leaf, type):
            continue
        if not isinstance(leaf, str):
            raise TraceError(f"leaf_modules entry {leaf!r} must be a module path (str) or a "
                             f"module class", module_type=type(model).__name__)
        if leaf not in paths:
            near = sorted(p for p in paths if p and (p.startswith(leaf) or leaf.startswith(p)))
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TraceError(f"leaf_modules: {type(model).__name__} has no module {leaf!r}"
                             f"{hint}", module_path=leaf, module_type=type(model).__name__)


@contextlib.contextmanager
def _buffers_kept(model: torch.nn.Module):
    """Put ``model``'s buffers back as they were on exit: a tracer that runs a forward's
    in-place updates for real (``num_batches_tracked += 1``) would otherwise change the user's
    model."""
    saved = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _record_input_names(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Record on each placeholder the forward parameter it stands for (fx renames a
    placeholder pinned to a default, e.g. ``b`` to ``b_1``), so keyword inputs bind by name."""
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(nodes) == len(params):
        for node, name in zip(nodes, params):
            meta.set_input_name(node, name)


def trace(model: torch.nn.Module, example_inputs: Union[Sequence[Any], Mapping[str, Any]], *,
          leaf_modules: Iterable[LeafSpec] = ()) -> fx.GraphModule:
    """Trace ``model``'s forward into a ``GraphModule`` that shares the model's parameters.

    ``example_inputs`` is a tuple of positional inputs (or a dict of keyword inputs, the usual
    form for Hugging Face models, which are captured through ``torch.export``; see
    ``tidal.ir.export_capture`` for the graph's form). Forward arguments not given are pinned
    to their defaults (``use_cache=False`` on the export path). ``leaf_modules`` (paths or
    classes) are kept as single ``call_module`` nodes (for Hugging Face models too); a path
    that names no submodule is a ``TraceError``. Raises ``TraceError`` naming the module and
    source line on failure. The graph's trace notes say which capture path was taken.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tidal can only trace torch.nn.Module instances, got {type(model).__name__}")
    leaf_modules = tuple(leaf_modules)
    _check_leaf_paths(model, leaf_modules)
    with tracing():     # fx patches torch.nn.Module process-wide while it traces
        saved = _plain_attributes(model)
        try:
            with _buffers_kept(model):
                return _trace_any(model, example_inputs, leaf_modules)
        finally:
            _restore_traced_attributes(model, saved)


def _plain_attributes(model: torch.nn.Module) -> dict[int, dict[str, Any]]:
    """Each module's plain attributes (its ``__dict__`` as it is now), by module id."""
    return {id(m): dict(vars(m)) for m in model.modules()}


def _restore_traced_attributes(model: torch.nn.Module, saved: dict[int, dict[str, Any]]) -> None:
    """Undo what tracing wrote onto the model: a forward that stores a traced value on its
    module (Hugging Face Swin's ``self.window_size = min(input_resolution)``) would leave an fx
    Proxy there (an export's fake tensor), breaking the model's next run or trace."""
    for m in model.modules():
        before = saved.get(id(m), {})
        for key, value in list(vars(m).items()):
            if isinstance(value, (fx.Proxy, FakeTensor)):
                if key in before:
                    setattr(m, key, before[key])
                else:
                    delattr(m, key)


def _trace_any(model: torch.nn.Module, example_inputs: Union[Sequence[Any], Mapping[str, Any]],
               leaf_modules: Sequence[LeafSpec]) -> fx.GraphModule:
    """A Hugging Face model through ``torch.export`` first (torch.fx, keeping failing modules
    whole, if the export fails); any other model through torch.fx first, then a top-level
    ``torch.nn`` built-in kept whole, then ``torch.export``."""
    if _is_hf_model(model):
        try:
            return export_trace(model, example_inputs, leaf_modules)
        except TraceError as export_error:
            return _trace_keeping_failures_whole(model, example_inputs, leaf_modules,
                                                 export_error)
    try:
        return _trace_fx(model, example_inputs, leaf_modules)
    except TraceError as e:
        if not e.module_path and type(model).__module__.startswith("torch.nn."):
            return _trace_whole(model, example_inputs, e)
        fx_error = e
    try:
        gm = export_trace(model, example_inputs, leaf_modules)
    except TraceError as export_error:
        raise TraceError(f"{fx_error} {export_error}", module_path=fx_error.module_path,
                         module_type=fx_error.module_type,
                         location=fx_error.location) from fx_error
    meta.set_trace_notes(gm, (f"torch.fx cannot trace {type(model).__name__} "
                              f"({_reason(fx_error)}); traced with {EXPORT} instead",)
                         + meta.get_trace_notes(gm)[1:])
    return gm


def _trace_whole(model: torch.nn.Module, example_inputs: Union[Sequence[Any], Mapping[str, Any]],
                 error: TraceError) -> fx.GraphModule:
    """A ``torch.nn`` built-in whose own forward fx cannot trace (``nn.TransformerEncoder``
    checks ``src.is_nested``) as one ``call_module`` node of a graph that calls it (its
    parameters are then named ``model.<name>``), with a trace note saying so."""
    root = torch.nn.Module()
    root.add_module("model", model)
    graph = fx.Graph()
    names = [p for p in inspect.signature(model.forward).parameters]
    if isinstance(example_inputs, Mapping):
        given = [n for n in names if n in example_inputs]
        kwargs = {n: graph.placeholder(n) for n in given}
        args: tuple = ()
    else:
        args = tuple(graph.placeholder(n) for n in names[:len(example_inputs)])
        kwargs = {}
    graph.output(graph.call_module("model", args, kwargs))
    gm = fx.GraphModule(root, graph, type(model).__name__)
    _record_input_names(gm, model)
    cause = error.__cause__ if error.__cause__ is not None else error
    why = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:120]
    meta.set_trace_notes(gm, (f"torch.fx cannot trace the forward of {type(model).__name__} "
                              f"({why}); it is kept whole as one node",))
    return gm


def _trace_fx(model: torch.nn.Module, example_inputs: Union[Sequence[Any], Mapping[str, Any]],
              leaf_modules: Sequence[LeafSpec]) -> fx.GraphModule:
    """Plain ``torch.fx`` tracing with ``leaf_modules`` kept whole; ``TraceError`` on failure
    (its ``module_path`` names the innermost module being traced).

    Buffers are traced as proxies, so their in-place updates are in the graph. A forward whose
    Python needs a buffer's value (``if self.initialized:``) is traced again with buffers as
    plain tensors, as fx does by default; if that trace updated a buffer for real (an update
    the graph then lacks) it is a ``TraceError`` naming the buffer, and the capture goes on to
    ``torch.export``, which keeps the update."""
    try:
        return _trace_fx_once(model, example_inputs, leaf_modules, proxy_buffers=True)
    except TraceError:
        return _trace_fx_once(model, example_inputs, leaf_modules, proxy_buffers=False)


def _trace_fx_once(model: torch.nn.Module,
                   example_inputs: Union[Sequence[Any], Mapping[str, Any]],
                   leaf_modules: Sequence[LeafSpec], proxy_buffers: bool) -> fx.GraphModule:
    """One ``torch.fx`` trace (see :func:`_trace_fx`)."""
    n_pos = 0 if isinstance(example_inputs, Mapping) else len(example_inputs)
    given = example_inputs.keys() if isinstance(example_inputs, Mapping) else ()
    tracer = _Tracer(leaf_modules, proxy_buffers=proxy_buffers)
    versions = {name: b._version for name, b in model.named_buffers()}
    try:
        graph = tracer.trace(model, concrete_args=_concrete_defaults(model, n_pos, given) or None)
    except TraceError:
        raise
    except Exception as e:
        raise _trace_error(model, tracer, e) from e
    _check_no_buffer_written(model, versions)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _record_input_names(gm, model)
    return gm


def _check_no_buffer_written(model: torch.nn.Module, versions: Mapping[str, int]) -> None:
    """Raise ``TraceError`` naming a buffer of ``model`` written in place while tracing (its
    version moved since ``versions``): the trace ran that update instead of recording it."""
    for name, b in model.named_buffers():
        if b._version != versions.get(name, b._version):
            owner, _, _ = name.rpartition(".")
            raise TraceError(
                f"cannot trace {type(model).__name__} with torch.fx: buffer {name!r} is updated "
                f"in place by Python torch.fx runs at trace time instead of recording (the "
                f"graph would drop the update)", module_path=owner,
                module_type=type(model.get_submodule(owner)).__name__)


def _reason(error: TraceError) -> str:
    """The cause in a failed capture: the error's first line, without what tidal adds."""
    cause = error.__cause__ if error.__cause__ is not None else error
    return ((str(cause).strip().splitlines() or [type(cause).__name__])[0]
            .split(" If this forward has")[0][:200])


MAX_FALLBACK_LEAVES = 64
"""How many modules the tracing fallback may keep whole before it gives up."""


def _trace_keeping_failures_whole(model: torch.nn.Module,
                                  example_inputs: Union[Sequence[Any], Mapping[str, Any]],
                                  leaf_modules: Sequence[LeafSpec], first: TraceError
                                  ) -> fx.GraphModule:
    """The fallback for a Hugging Face model ``torch.export`` cannot capture: plain
    ``torch.fx``, keeping each module whose forward fails to trace whole (a leaf) and tracing
    again. The modules kept whole are recorded as trace notes for the compile report. Raises a
    ``TraceError`` naming both failures (the module and line of the export's) when the
    top-level forward itself cannot be traced."""
    leaves = list(leaf_modules)
    kept: list[str] = []
    for _ in range(MAX_FALLBACK_LEAVES):
        try:
            gm = _trace_fx(model, example_inputs, leaves)
        except TraceError as e:
            if not e.module_path or e.module_path in leaves:
                raise TraceError(f"{first} Falling back to torch.fx also failed: {e}",
                                 module_path=first.module_path or e.module_path,
                                 module_type=first.module_type or e.module_type,
                                 location=first.location or e.location) from first
            leaves.append(e.module_path)
            kept.append(f"{e.module_path} ({e.module_type})")
            continue
        meta.set_trace_notes(gm, (
            f"{EXPORT} cannot capture {type(model).__name__} "
            f"({_reason(first)}); traced with torch.fx instead"
            + (f", keeping whole the modules whose forward cannot be traced: {', '.join(kept)}"
               if kept else ""),))
        return gm
    raise TraceError(f"{first} Falling back to torch.fx kept {len(kept)} modules whole and "
                     f"still failed", module_type=type(model).__name__)


@dataclass
class TrainStep:
    """A whole training step as one aten graph.

    ``gm(params, buffers, inputs, targets, seed)`` returns ``(loss, grads)`` where ``params``
    and ``buffers`` are dicts keyed by ``param_names``/``buffer_names``, ``seed`` is the
    backward's seed (:func:`loss_seed`: a 0-dim float32 tensor, 1.0 for the plain gradients)
    and ``grads`` a tuple in ``param_names`` order: the gradients of ``seed * loss``, computed
    as eager ``(loss * seed).backward()`` computes them (the seed is the loss's gradient), so
    that a loss scale (``GradScaler``'s) keeps fp16 intermediate gradients from underflowing
    as in eager; ``loss`` stays unscaled. Buffer updates (BatchNorm running statistics, a forward's
    ``self.count.add_(1)``: :func:`buffer_writes`) happen in place on the buffers passed in,
    as in eager training.
    """

    gm: fx.GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    statistic_names: frozenset[str] = frozenset()
    """The buffers that are a normalization layer's running statistics (BatchNorm's)."""

    def run(self, model: torch.nn.Module, inputs: Union[Sequence[Any], Mapping[str, Any]],
            targets: Any, seed: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the captured step on ``model``'s own parameters and buffers; return the loss and
        the gradients of ``seed * loss`` (``seed``: None for 1, a number or a 0-dim tensor) by
        parameter name (the model's ``.grad`` fields are not touched). The graph computes the
        gradients itself, so it runs without autograd: a buffer it updates takes no autograd
        history, as under the forward's ``torch.no_grad()``."""
        with torch.no_grad():
            loss, grads = self.gm(*step_inputs(self, model, inputs, targets, seed, flat=False))
        return loss, dict(zip(self.param_names, grads))


def as_inputs(inputs: Union[Sequence[Any], Mapping[str, Any]]) -> Union[tuple, dict]:
    """Positional inputs as a tuple, keyword inputs (a dict) as a dict."""
    return dict(inputs) if isinstance(inputs, Mapping) else tuple(inputs)


def _call_args(inputs: Union[tuple, dict]) -> tuple[tuple, dict]:
    """(args, kwargs) to call the model with: a dict stays keyword inputs."""
    return ((), inputs) if isinstance(inputs, dict) else (inputs, {})


def capture_train_step(model: torch.nn.Module,
                       example_inputs: Union[Sequence[Any], Mapping[str, Any]], example_targets: Any,
                       loss_fn: Callable[[Any, Any], torch.Tensor]) -> TrainStep:
    """Capture forward, ``loss_fn(outputs, targets)`` and backward of ``model`` as one aten-level
    graph (``make_fx`` with fake tensors of a step that calls ``torch.func.functional_call`` and
    ``torch.autograd.grad``). Parameters and buffers (BatchNorm statistics) are graph inputs;
    a buffer the forward updates in place is written in place by the graph, as in eager.
    ``example_inputs`` is a tuple of positional inputs or a dict of keyword inputs."""
    params = trainable(model)
    buffers = dict(model.named_buffers())
    names = tuple(params)

    def step(params, buffers, inputs, targets, seed):
        args, kwargs = _call_args(inputs)
        out = torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
        loss = loss_fn(out, targets)
        grads = torch.autograd.grad(loss, [params[k] for k in names],
                                    grad_outputs=seed_for(loss, seed), allow_unused=True)
        grads = tuple(torch.zeros_like(params[k]) if g is None else g for k, g in zip(names, grads))
        return loss, grads

    seed = loss_seed(None, device_of_step(params, buffers, example_inputs))
    try:
        gm = make_fx(step, tracing_mode="fake")(params, buffers, as_inputs(example_inputs),
                                                 example_targets, seed)
    except Exception as e:
        frame = _user_frame(e)
        where = f" at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
        raise TraceError(
            f"cannot capture a training step of {type(model).__name__}{where}: "
            f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}",
            module_type=type(model).__name__,
            location=f"{frame.filename}:{frame.lineno}" if frame else "") from e
    return TrainStep(gm=gm, param_names=names, buffer_names=tuple(buffers),
                     statistic_names=running_statistics(model))


def grad_nodes(step: TrainStep) -> tuple[fx.Node, list[fx.Node]]:
    """The loss node and each parameter's gradient node in the joint graph's output."""
    out = next(n for n in step.gm.graph.nodes if n.op == "output")
    flat = list(out.args[0])
    return flat[0], flat[1:1 + len(step.param_names)]


def step_inputs(step: TrainStep, module: torch.nn.Module, inputs: Any, targets: Any,
                seed: Any = None, *, flat: bool = True) -> list[Any]:
    """The captured step's flat inputs: ``module``'s parameters and buffers, the inputs, the
    targets and the backward's seed (:func:`loss_seed` of ``seed``: None for 1, a number or
    a 0-dim tensor such as a ``GradScaler``'s scale), last. With ``flat`` False, the five
    arguments ``step.gm`` takes, unflattened.

    >>> model = torch.nn.Linear(2, 2)
    >>> x, y = torch.randn(3, 2), torch.tensor([0, 1, 1])
    >>> step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
    >>> flat = step_inputs(step, model, (x,), y, seed=0.25)
    >>> len(flat), flat[-1]
    (5, tensor(0.2500))
    """
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    chosen = ({k: params[k] for k in step.param_names}, {k: buffers[k] for k in step.buffer_names})
    device = device_of_step(*chosen, inputs)
    args = (*chosen, as_inputs(inputs), targets, loss_seed(seed, device))
    if not flat:
        return list(args)
    return fx_pytree.tree_flatten_spec(args, step.gm.graph._codegen.pytree_info.in_spec)


def loss_seed(scale: Any = None, device: Union[torch.device, str, None] = None,
              weight: Optional[float] = None) -> torch.Tensor:
    """The backward's seed of a captured step for the loss times ``scale`` (None: 1; a number,
    ``1 / k`` for accumulation, or a 0-dim tensor, a ``GradScaler``'s scale) times ``weight``
    (None: 1; a shard's row weight): a 0-dim float32 tensor on ``device`` (``scale``'s when
    it is a tensor and ``device`` is None; else the CPU).

    >>> loss_seed(), loss_seed(0.5, weight=0.5), loss_seed(torch.tensor(2.0 ** 16)).item()
    (tensor(1.), tensor(0.2500), 65536.0)
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"a loss scale must be one number (a 0-dim tensor, a GradScaler's "
                             f"scale), got a tensor of shape {tuple(scale.shape)}")
        seed = scale.detach().reshape(()).to(
            dtype=torch.float32, device=scale.device if device is None else device)
        return seed if weight is None else seed * weight
    value = (1.0 if scale is None else float(scale)) * (1.0 if weight is None else weight)
    return torch.tensor(value, dtype=torch.float32, device=device)


def seed_for(loss: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """``seed`` as the gradient of ``loss`` (its dtype and shape), what eager
    ``(loss * seed).backward()`` hands to ``loss``'s backward."""
    if seed.dtype != loss.dtype:
        seed = seed.to(loss.dtype)
    return seed if seed.shape == loss.shape else seed.expand(loss.shape)


def device_of_step(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                   inputs: Any) -> torch.device:
    """The device of a step's first parameter, buffer or input tensor (the CPU when none)."""
    leaves = [*params.values(), *buffers.values(), *tree_leaves(inputs)]
    return next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))


def failing_node(step: TrainStep, flat: Sequence[Any]) -> str:
    """Which node of the captured step fails on copies of ``flat``, and how ('' if none)."""
    interp = fx.Interpreter(step.gm, garbage_collect_values=False)
    interp.args_iter = iter([v.detach().clone() if isinstance(v, torch.Tensor) else v
                             for v in flat])
    with torch.no_grad():
        for node in step.gm.graph.nodes:
            try:
                interp.env[node] = interp.run_node(node)
            except Exception as e:  # noqa: BLE001 - what is wrong is the answer
                first = (str(e).strip().splitlines() or [""])[0][:300]
                return f"node {node.name!r} ({node.target}): {type(e).__name__}: {first}"
    return ""


# --- buffers updated in place -----------------------------------------------------------------

_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
_TORCH_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class BufferUpdateError(TidalError):
    """A buffer the forward updates in place (``self.ema.mul_(0.9)``) whose update tidal cannot
    keep as eager does under a pass. Carries ``buffer`` (its qualified name), ``op`` and
    ``location`` (``file:line`` of the update, if known)."""

    def __init__(self, message: str, *, buffer: str, op: str = "", location: str = ""):
        super().__init__(message)
        self.buffer, self.op, self.location = buffer, op, location


@dataclass(frozen=True)
class BufferWrite:
    """An in-place update of a buffer in a captured graph: the buffer's qualified name, the op
    (``mul_``, ``add_``, ``copy_``) and the user's ``file:line`` when the capture recorded it."""

    buffer: str
    op: str
    location: str = ""

    def describe(self) -> str:
        """``mul_ at model.py:12`` (or the op alone)."""
        return f"{self.op} at {self.location}" if self.location else self.op


def running_statistics(model: torch.nn.Module) -> frozenset[str]:
    """Qualified names of the buffers that are running statistics of a normalization layer
    (``running_mean``, ``running_var``, ``num_batches_tracked`` of a module that tracks them:
    BatchNorm, InstanceNorm with ``track_running_stats``)."""
    return frozenset(
        f"{path}.{name}" if path else name for path, m in model.named_modules()
        if getattr(m, "track_running_stats", False)
        for name, _ in m.named_buffers(recurse=False) if name in _STATISTICS)


def buffer_writes(graph: Union[fx.GraphModule, TrainStep], *,
                  statistics: bool = False) -> tuple[BufferWrite, ...]:
    """The in-place buffer updates of a captured forward (``trace``) or training step
    (``capture_train_step``), in graph order; running statistics of normalization layers
    (:func:`running_statistics`) only with ``statistics=True``.

    >>> class Counter(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(2, 2)
    ...         self.register_buffer("count", torch.zeros(()))
    ...     def forward(self, x):
    ...         self.count.add_(1)
    ...         return self.lin(x)
    >>> x = torch.randn(3, 2)
    >>> [(w.buffer, w.op) for w in buffer_writes(trace(Counter(), (x,)))]
    [('count', 'add_')]
    >>> step = capture_train_step(Counter(), (x,), torch.tensor([0, 1, 1]),
    ...                           torch.nn.functional.cross_entropy)
    >>> [(w.buffer, w.op) for w in buffer_writes(step)]
    [('count', 'add_')]
    """
    gm = graph.gm if isinstance(graph, TrainStep) else graph
    names = _buffer_nodes(graph)
    skip = frozenset() if statistics else (
        graph.statistic_names if isinstance(graph, TrainStep) else running_statistics(gm))
    found: list[BufferWrite] = []
    for n in gm.graph.nodes:
        for w in written_nodes(gm, n):
            name = names.get(w)
            if name is not None and name not in skip:
                write = BufferWrite(name, op_name(n), _location(n))
                if write not in found:
                    found.append(write)
    return tuple(found)


def refuse_buffer_writes(graph: Union[fx.GraphModule, TrainStep], under: str, why: str) -> None:
    """Raise :class:`BufferUpdateError` naming the first buffer ``graph`` updates in place
    (:func:`buffer_writes`; running statistics are left to the caller), for a pass ``under``
    that cannot keep the update as eager does, because ``why``.

    >>> class Ema(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("ema", torch.zeros(2))
    ...     def forward(self, x):
    ...         self.ema.mul_(0.9).add_(x.mean(0) * 0.1)
    ...         return x * 2
    >>> try:
    ...     refuse_buffer_writes(trace(Ema(), (torch.randn(3, 2),)), "round_robin",
    ...                          "each partition runs once per micro-batch")
    ... except BufferUpdateError as e:
    ...     print(e.buffer, e.op)
    ema mul_
    """
    writes = buffer_writes(graph)
    if not writes:
        return
    first = writes[0]
    more = sorted({w.buffer for w in writes} - {first.buffer})
    also = f" (also updated in place: {', '.join(repr(b) for b in more)})" if more else ""
    raise BufferUpdateError(
        f"buffer {first.buffer!r} is updated in place in forward ({first.describe()}); tidal "
        f"cannot keep that update under {under}: {why}{also}. Update the buffer outside the "
        f"compiled step (after compiled.step returns), or compile without {under}",
        buffer=first.buffer, op=first.op, location=first.location)


def _buffer_nodes(graph: Union[fx.GraphModule, TrainStep]) -> dict[fx.Node, str]:
    """The nodes of ``graph`` that stand for a buffer, with its qualified name: a step's buffer
    placeholders, a forward's ``get_attr`` nodes reading a tensor that is not a parameter."""
    if isinstance(graph, TrainStep):
        holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
        first = len(graph.param_names)
        return dict(zip(holders[first:first + len(graph.buffer_names)], graph.buffer_names))
    found = {}
    for n in graph.graph.nodes:
        if n.op == "get_attr":
            value = fetch_attr(graph, n.target)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found[n] = n.target
    return found


def _location(n: fx.Node) -> str:
    """``file:line`` of the innermost user frame in ``n``'s recorded stack trace ('' if
    none)."""
    frames = [(f, line) for f, line in _TORCH_FRAME.findall(n.meta.get("stack_trace") or "")
              if not os.path.abspath(f).startswith(_TORCH_DIR) and "<" not in f]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""
