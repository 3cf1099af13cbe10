"""Load a model named on the command line: ``module:factory``, ``path/to/file.py:factory``, or
the name of an in-repo zoo model (``resnet50_small``) when run from the repository; its example
inputs, and the loss, targets and optimizer the training passes compile with."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from tidal.compiler.cli_errors import ShapeSpec, UsageError, check_input_size, parse_shape


class ModelSpecError(UsageError):
    """A MODEL argument that names no model factory, or inputs or a loss that do not fit it."""


ZOO_MODULE = "examples.models"
"""Where short MODEL names (``resnet50_small``) are looked up: a module with a ``ZOO`` mapping
of name -> factory, loaded like any ``module:factory`` spec (the in-repo zoo, importable from a
checkout; the environment variable ``TIDAL_ZOO`` names another)."""


def _zoo() -> dict[str, Callable[[], torch.nn.Module]] | None:
    try:
        module = importlib.import_module(os.environ.get("TIDAL_ZOO", ZOO_MODULE))
    except ImportError:
        return None
    return dict(getattr(module, "ZOO", {}))


def cwd_importable() -> None:
    """Put the working directory on ``sys.path`` (as ``python -m`` does), so user modules and,
    from a checkout, the in-repo zoo ``examples.models`` can be imported."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _import_module(spec: str, name: str):
    """Import the dotted module ``name`` for MODEL ``spec``."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ModelSpecError(f"MODEL {spec!r}: cannot import module {name!r} ({e})") from e


def package_module_name(path: Path) -> tuple[Path, str] | None:
    """(directory for ``sys.path``, dotted module name) under which the file ``path`` imports
    as a module of its package, so that relative imports inside it work; None for a file that
    is not in a package (no ``__init__.py`` beside it).

    The package is the chain of directories above ``path`` that have an ``__init__.py``; the
    name starts below the outermost of their parents that is already on ``sys.path`` (as
    ``python -m`` would name it from there), else at the top of the chain."""
    path = path.resolve()
    roots = []  # the parent of each package directory holding the file, innermost first
    d = path.parent
    while (d / "__init__.py").is_file() and d.parent != d:
        roots.append(d.parent)
        d = d.parent
    if not roots:
        return None
    on_path = {Path(p or os.getcwd()).resolve() for p in sys.path}
    root = next((r for r in reversed(roots) if r in on_path), roots[-1])
    return root, ".".join(path.relative_to(root).with_suffix("").parts)


def _exec_file(path: Path):
    """Import a file that is in no package as a module named after its stem."""
    mod_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _import_in_package(path: Path, root: Path, name: str):
    """Import ``path`` as the module ``name`` of its package, with ``root`` on ``sys.path``."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(name)
    if Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
        raise ImportError(f"the name {name!r} is already taken by {module.__file__}")
    return module


def _import_file(spec: str, where: str):
    """Import ``path/to/file.py`` for MODEL ``spec``: as a module of its package when it is in
    one (``pkg/sub/mod.py`` as ``pkg.sub.mod``), else on its own."""
    path = Path(where)
    if not path.is_file():
        raise ModelSpecError(f"MODEL {spec!r}: file {where} does not exist")
    package = package_module_name(path)
    as_name = f" as module {package[1]}" if package else ""
    try:
        return _import_in_package(path, *package) if package else _exec_file(path)
    except Exception as e:
        raise ModelSpecError(f"MODEL {spec!r}: importing {where}{as_name} failed: "
                             f"{type(e).__name__}: {e}") from e


def load_factory(spec: str) -> Callable[[], Any]:
    """The factory that ``spec`` names. Raises ``ModelSpecError`` with one clear line."""
    cwd_importable()
    if ":" not in spec:
        zoo = _zoo()
        if zoo is not None and spec in zoo:
            return zoo[spec]
        known = f"; zoo models: {', '.join(sorted(zoo))}" if zoo else ""
        raise ModelSpecError(
            f"MODEL {spec!r} must be module:factory or path/to/file.py:factory{known}")
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ModelSpecError(f"MODEL {spec!r} must be module:factory or path/to/file.py:factory")
    module = _import_file(spec, where) if where.endswith(".py") or os.sep in where \
        else _import_module(spec, where)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ModelSpecError(f"MODEL {spec!r}: {where} has no callable {name!r}")
    return factory


def build_model(spec: str) -> torch.nn.Module:
    """Call the factory ``spec`` names and check it returned an ``nn.Module``."""
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as e:
        raise ModelSpecError(f"MODEL {spec!r}: the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"MODEL {spec!r}: the factory returned {type(model).__name__}, "
                             "not a torch.nn.Module")
    return model


def parse_input_shape(text: str, batch: int) -> torch.Tensor:
    """A random example input from ``3,224,224`` (float) or ``long:16`` / ``long[1000]:16``
    (token ids below 1000, default 100); the batch dimension is prepended. A
    ``ModelSpecError`` for a shape :func:`~tidal.compiler.cli_errors.parse_shape` refuses or
    inputs over ``MAX_INPUT_ELEMENTS``, before anything is allocated.

    Example:
        >>> parse_input_shape("long[7]:3", 2).shape
        torch.Size([2, 3])
    """
    shape = _shape(text)
    check_input_size(f"--input-shape {text} at batch {batch}", batch * shape.elements)
    gen = torch.Generator().manual_seed(0)
    if shape.dtype == "long":
        return torch.randint(0, shape.high, (batch, *shape.dims), generator=gen)
    return torch.randn(batch, *shape.dims, generator=gen)


def _shape(text: str) -> ShapeSpec:
    try:
        return parse_shape(text)
    except ValueError as e:
        raise ModelSpecError(f"--input-shape {e}") from None


def _per_sample_elements(example_inputs: Callable[[int], Any]) -> int:
    """Elements of the model's example inputs at batch 1 (0 when it cannot make them), the RNG
    left as it was, so the inputs at the real batch are the ones they were without the probe."""
    with torch.random.fork_rng(devices=[]):
        try:
            return _elements(example_inputs(1))
        except Exception:  # only a size guard: the real call below reports its own failure
            return 0


def _elements(value: Any) -> int:
    """Elements of the tensors in ``value`` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return sum(_elements(v) for v in value)
    return 0


def example_inputs_for(model: torch.nn.Module, spec: str, batch: int,
                       input_shapes: list[str] | None) -> tuple:
    """Example inputs from ``--input-shape`` options, else from the model's own
    ``example_inputs(batch)`` method (zoo models have one). Inputs of more than
    ``MAX_INPUT_ELEMENTS`` elements in all are a ``UsageError`` before they are allocated
    (the model's own are sized from its inputs at batch 1)."""
    if input_shapes:
        total = sum(batch * _shape(s).elements for s in input_shapes)
        check_input_size(f"--batch {batch} with " + " ".join(f"--input-shape {s}"
                                                              for s in input_shapes), total)
        return tuple(parse_input_shape(s, batch) for s in input_shapes)
    fn = getattr(model, "example_inputs", None)
    if callable(fn):
        check_input_size(f"--batch {batch} for MODEL {spec!r}", batch * _per_sample_elements(fn))
        return tuple(fn(batch))
    raise ModelSpecError(f"MODEL {spec!r} has no example_inputs(batch) method: "
                         "give --input-shape (e.g. --input-shape 3,224,224)")


def _running(model: torch.nn.Module, inputs: tuple) -> Any:
    """``model(*inputs)`` without gradients and in eval mode (no BatchNorm statistics are
    updated), each submodule's train/eval mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return model(*inputs)
    finally:
        for m, training in modes:
            m.training = training


def check_inputs_fit(model: torch.nn.Module, inputs: tuple, spec: str,
                     input_shapes: list[str]) -> Any:
    """Run ``model`` once on the inputs built from ``--input-shape``; its outputs, or a
    ``ModelSpecError`` naming the shapes that do not fit, with the model's own complaint."""
    try:
        return _running(model, inputs)
    except Exception as e:  # any failure of the user's forward on these inputs
        shapes = " ".join(f"--input-shape {s}" for s in input_shapes)
        first = (str(e).strip().splitlines() or [""])[0]
        raise ModelSpecError(f"{shapes} does not fit MODEL {spec!r}: running it failed with "
                             f"{type(e).__name__}: {first}") from e


def cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class scores (the last dim of the outputs or their logits) against class
    indices of the outputs' other dims."""
    scores = _scores(outputs)
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1))


def mse(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the outputs (or their logits) against targets of the same shape."""
    return F.mse_loss(_scores(outputs), targets)


def _scores(outputs: Any) -> torch.Tensor:
    """The tensor a loss reads: the outputs, their ``logits`` (an attribute of a Hugging Face
    output, a key of the dict its traced graph returns), or their first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(f"the model returns {type(outputs).__name__}, not a tensor")


def _derived_targets(loss: str, outputs: Any) -> torch.Tensor:
    """Random targets for ``loss`` that fit the model's outputs: class indices below the size of
    the last dim for cross_entropy, values of the outputs' shape for mse."""
    scores = _scores(outputs)
    gen = torch.Generator().manual_seed(0)
    if loss == "mse":
        return torch.randn(scores.shape, generator=gen).to(scores)
    return torch.randint(0, scores.shape[-1], scores.shape[:-1], generator=gen).to(scores.device)


def loss_and_targets(model: torch.nn.Module, spec: str, loss: str, batch: int,
                     inputs: tuple) -> tuple[Any, Any]:
    """The training loss ``--loss`` names and example targets at ``batch``: ``default`` is the
    model's ``default_loss`` and ``example_targets(batch)`` where it has them, else
    cross-entropy over class targets; targets the model does not give are derived from its
    outputs on ``inputs``. A ``ModelSpecError`` naming ``--loss`` when they cannot be."""
    own_loss = getattr(model, "default_loss", None)
    own_targets = getattr(model, "example_targets", None)
    name = "cross_entropy" if loss == "default" and own_loss is None else loss
    loss_fn = {"default": own_loss, "cross_entropy": cross_entropy, "mse": mse}[name]
    if name == "default" and callable(own_targets):  # the model's targets fit its own loss
        return loss_fn, own_targets(batch)
    try:
        return loss_fn, _derived_targets(name, _running(model, inputs))
    except (TypeError, IndexError) as e:
        raise ModelSpecError(f"--loss {loss}: cannot derive {name} targets for MODEL {spec!r} "
                             f"({e}); give a model with default_loss and example_targets(batch)"
                             ) from None


def optimizer_factory(name: str, lr: float | None) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for ``--optimizer`` (sgd or adam) at ``--lr`` (default 0.1 for
    sgd, 0.001 for adam)."""
    cls, default_lr = {"sgd": (torch.optim.SGD, 0.1), "adam": (torch.optim.Adam, 1e-3)}[name]
    return functools.partial(cls, lr=default_lr if lr is None else lr)
