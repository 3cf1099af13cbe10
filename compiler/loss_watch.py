"""What a ``loss_fn`` reads besides its arguments, so a captured step never runs a stale one.

Under a plan's program the loss function is traced once, into the training step captured at
the first step: a Python value it reads there (a weight in a global or a closure, an attribute
of the object whose method it is, a ``functools.partial`` argument) becomes a constant of the
capture. :func:`loss_reads` lists those values (by name) and :func:`changed_reads` says which
of them changed since, so the guard (``tidal.compiler.guards``) raises naming the variable
instead of training with the old value. Values are compared by their plain Python value
(numbers, strings, tuples of them) or, for tensors, by identity and in-place version.

Example:
    >>> import torch.nn.functional as F
    >>> weight = [1.0]
    >>> def loss_fn(out, target):
    ...     return F.mse_loss(out, target) * weight[0]
    >>> before = loss_reads(loss_fn)
    >>> weight[0] = 0.5
    >>> changed_reads(loss_fn, before)
    ["global 'weight'"]
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch

_PLAIN = (int, float, bool, str, bytes, type(None))


def _fingerprint(value: Any, depth: int = 0) -> Any:
    """A comparable summary of ``value`` (None: not something a trace bakes in)."""
    if isinstance(value, _PLAIN):
        return ("v", value)
    if isinstance(value, torch.Tensor):
        return ("t", id(value), value._version)
    if depth < 2 and isinstance(value, (list, tuple)):
        return ("s", tuple(_fingerprint(v, depth + 1) for v in value))
    if depth < 2 and isinstance(value, dict):
        return ("d", tuple((k, _fingerprint(v, depth + 1)) for k, v in value.items()
                           if isinstance(k, _PLAIN)))
    if depth < 1 and isinstance(value, torch.nn.Module):
        return ("m", tuple((k, _fingerprint(v, depth + 1)) for k, v in vars(value).items()
                           if not k.startswith("_")),
                tuple((k, id(b), b._version) for k, b in value.named_buffers()))
    return None


def loss_reads(loss_fn: Callable) -> dict[str, Any]:
    """Name -> fingerprint of each value ``loss_fn`` reads besides its arguments: globals its
    code names, its closure's cells, its defaults, the attributes of its ``self`` (a bound
    method, or a loss module's own attributes: ``weight``, ``label_smoothing``...), and a
    ``functools.partial``'s arguments."""
    reads: dict[str, Any] = {}
    fn = loss_fn
    if isinstance(fn, functools.partial):
        for i, v in enumerate(fn.args):
            reads[f"partial argument {i}"] = _fingerprint(v)
        for k, v in fn.keywords.items():
            reads[f"partial argument {k!r}"] = _fingerprint(v)
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        reads["the loss module's attributes"] = _fingerprint(fn)
        fn = type(fn).forward
    if isinstance(fn, types.MethodType):
        reads["its object's attributes"] = _fingerprint(fn.__self__)
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        code_names = set(fn.__code__.co_names)
        for name in sorted(code_names & set(fn.__globals__)):
            value = fn.__globals__[name]
            if not (inspect.ismodule(value) or callable(value)):
                reads[f"global {name!r}"] = _fingerprint(value)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if not callable(value):
                reads[f"closure variable {name!r}"] = _fingerprint(value)
        for i, value in enumerate(fn.__defaults__ or ()):
            reads[f"default argument {i}"] = _fingerprint(value)
    return {k: v for k, v in reads.items() if v is not None}


def changed_reads(loss_fn: Callable, before: dict[str, Any]) -> list[str]:
    """The names of :func:`loss_reads` whose value differs from ``before``."""
    now = loss_reads(loss_fn)
    return [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
