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
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import _pytree as fx_pytree
from torch.fx.experimental.proxy_tensor import make_fx

from tidal.ir import meta
from tidal.ir.errors import TraceError
from tidal.ir.export_capture import NAME as EXPORT
from tidal.ir.export_capture import LeafSpec, export_trace, user_leaf
from tidal.ir.param_owners import trainable

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
    tracing failed."""

    def __init__(self, leaf_modules: Iterable[LeafSpec] = ()):
        super().__init__()
        self.user_leaf = user_leaf(leaf_modules)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return self.user_leaf(m, qualname) or super().is_leaf_module(m, qualname)


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
    (its ``module_path`` names the innermost module being traced)."""
    n_pos = 0 if isinstance(example_inputs, Mapping) else len(example_inputs)
    given = example_inputs.keys() if isinstance(example_inputs, Mapping) else ()
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=_concrete_defaults(model, n_pos, given) or None)
    except TraceError:
        raise
    except Exception as e:
        raise _trace_error(model, tracer, e) from e
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _record_input_names(gm, model)
    return gm


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

    ``gm(params, buffers, inputs, targets)`` returns ``(loss, grads)`` where ``params`` and
    ``buffers`` are dicts keyed by ``param_names``/``buffer_names`` and ``grads`` a tuple in
    ``param_names`` order. Buffer updates (BatchNorm running statistics) happen in place on the
    buffers passed in, as in eager training.
    """

    gm: fx.GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]

    def run(self, model: torch.nn.Module, inputs: Union[Sequence[Any], Mapping[str, Any]],
            targets: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the captured step on ``model``'s own parameters and buffers; return the loss and
        the gradients by parameter name (the model's ``.grad`` fields are not touched)."""
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        loss, grads = self.gm({k: params[k] for k in self.param_names},
                              {k: buffers[k] for k in self.buffer_names}, as_inputs(inputs),
                              targets)
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
    ``torch.autograd.grad``). Parameters and buffers (BatchNorm statistics) are graph inputs.
    ``example_inputs`` is a tuple of positional inputs or a dict of keyword inputs."""
    params = trainable(model)
    buffers = dict(model.named_buffers())
    names = tuple(params)

    def step(params, buffers, inputs, targets):
        args, kwargs = _call_args(inputs)
        out = torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
        loss = loss_fn(out, targets)
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        grads = tuple(torch.zeros_like(params[k]) if g is None else g for k, g in zip(names, grads))
        return loss, grads

    try:
        gm = make_fx(step, tracing_mode="fake")(params, buffers, as_inputs(example_inputs),
                                                 example_targets)
    except Exception as e:
        frame = _user_frame(e)
        where = f" at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
        raise TraceError(
            f"cannot capture a training step of {type(model).__name__}{where}: "
            f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}",
            module_type=type(model).__name__,
            location=f"{frame.filename}:{frame.lineno}" if frame else "") from e
    return TrainStep(gm=gm, param_names=names, buffer_names=tuple(buffers))


def grad_nodes(step: TrainStep) -> tuple[fx.Node, list[fx.Node]]:
    """The loss node and each parameter's gradient node in the joint graph's output."""
    out = next(n for n in step.gm.graph.nodes if n.op == "output")
    flat = list(out.args[0])
    return flat[0], flat[1:1 + len(step.param_names)]


def step_inputs(step: TrainStep, module: torch.nn.Module, inputs: Any, targets: Any) -> list[Any]:
    """The captured step's flat inputs: ``module``'s parameters and buffers, the inputs, the
    targets."""
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    return fx_pytree.tree_flatten_spec(
        ({k: params[k] for k in step.param_names}, {k: buffers[k] for k in step.buffer_names},
         as_inputs(inputs), targets), step.gm.graph._codegen.pytree_info.in_spec)


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
