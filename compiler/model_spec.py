"""Load a model named on the command line: ``module:factory``, ``path/to/file.py:factory``, or
the name of an in-repo zoo model (``resnet50_small``) when run from the repository."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from tidal.ir.errors import TidalError


class ModelSpecError(TidalError, ValueError):
    """A MODEL argument that names no model factory."""


def _zoo() -> dict[str, Callable[[], torch.nn.Module]] | None:
    try:
        from examples.models import ZOO  # only importable from a checkout of the repository
    except ImportError:
        return None
    return dict(ZOO)


def cwd_importable() -> None:
    """Put the working directory on ``sys.path`` (as ``python -m`` does), so user modules and,
    from a checkout, the in-repo zoo ``examples.models`` can be imported."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


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
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ModelSpecError(f"MODEL {spec!r}: file {where} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ModelSpecError(f"MODEL {spec!r}: importing {where} failed: "
                                 f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ModelSpecError(f"MODEL {spec!r}: cannot import module {where!r} ({e})") from e
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
    (token ids below 1000, default 100); the batch dimension is prepended."""
    dtype_part, sep, dims = text.rpartition(":")
    high = 100
    if sep and dtype_part.startswith("long"):
        if dtype_part != "long":
            try:
                high = int(dtype_part[len("long["):-1])
            except ValueError:
                raise ModelSpecError(f"--input-shape {text!r}: expected long[N]:dims") from None
        dtype = torch.long
    elif sep:
        raise ModelSpecError(f"--input-shape {text!r}: the only dtype prefix is long")
    else:
        dtype = torch.float32
    try:
        shape = [int(d) for d in dims.replace("x", ",").split(",") if d]
    except ValueError:
        raise ModelSpecError(f"--input-shape {text!r}: dims must be integers like 3,224,224") from None
    if any(d <= 0 for d in shape):
        raise ModelSpecError(f"--input-shape {text!r}: dims must be positive")
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.long:
        return torch.randint(0, high, (batch, *shape), generator=gen)
    return torch.randn(batch, *shape, generator=gen)


def example_inputs_for(model: torch.nn.Module, spec: str, batch: int,
                       input_shapes: list[str] | None) -> tuple:
    """Example inputs from ``--input-shape`` options, else from the model's own
    ``example_inputs(batch)`` method (zoo models have one)."""
    if input_shapes:
        return tuple(parse_input_shape(s, batch) for s in input_shapes)
    fn = getattr(model, "example_inputs", None)
    if callable(fn):
        return tuple(fn(batch))
    raise ModelSpecError(f"MODEL {spec!r} has no example_inputs(batch) method: "
                         "give --input-shape (e.g. --input-shape 3,224,224)")
