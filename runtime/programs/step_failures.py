"""Failure reporting of a program's step: one clear error, naming where it happened.

A piece that fails makes every later piece of the step fail at once, naming it
(:class:`FailFast`), so no rank waits at a collective for a peer that will not come; a
collective that fails or times out (its group has the world's timeout) becomes one
:class:`~tidal.ir.errors.TidalError` that says a peer stalled or died
(:func:`collective_errors`); an error raised inside generated graph code is told by the line
of the fx node that raised it (:func:`graph_line`, :func:`failure`).

Example:
    >>> guard = FailFast("demo")
    >>> first = guard.wrap("F0", lambda: 1 / 0)
    >>> second = guard.wrap("B0", lambda: None)
    >>> try:
    ...     first()
    ... except ZeroDivisionError:
    ...     pass
    >>> second()
    Traceback (most recent call last):
    ...
    RuntimeError: demo: piece 'B0' not run: piece 'F0' failed: ZeroDivisionError: division by zero
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Iterator

import torch.distributed as dist

from tidal.ir.errors import TidalError


class FailFast:
    """The first failure of one step of ``who``'s program: a piece wrapped by :meth:`wrap`
    runs only while no piece failed."""

    def __init__(self, who: str):
        self.who = who
        self.failed = ""  # 'piece NAME failed: ERROR' once one did

    def wrap(self, name: str, action: Callable[[], Any]) -> Callable[[], None]:
        """Piece ``name`` doing ``action``, guarded (see the class docstring)."""
        def run() -> None:
            if self.failed:
                raise RuntimeError(f"{self.who}: piece {name!r} not run: {self.failed}")
            try:
                action()
            except BaseException as e:
                self.failed = f"piece {name!r} failed: {type(e).__name__}: {e}"
                raise
        return run


@contextlib.contextmanager
def collective_errors(who: str, what: str) -> Iterator[None]:
    """Turn a failed or timed-out collective of ``what`` into one clear error instead of a
    deep gloo/NCCL traceback."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TidalError(f"{who}: {what} did not complete within the process group's "
                         f"timeout: a peer rank stalled or died ({type(e).__name__}: "
                         f"{first})") from e


def graph_line(exc: BaseException) -> str:
    """The innermost line of generated graph code (an fx node) in ``exc``'s traceback, or in
    that of the error it was raised from ('' if none)."""
    for e in (exc, exc.__cause__):
        if e is not None:
            line = next((f.line.strip() for f in reversed(traceback.extract_tb(
                e.__traceback__)) if f.filename.startswith("<eval_with_key") and f.line), "")
            if line:
                return line
    return ""


def failure(what: str, exc: BaseException) -> str:
    """``what``, the line of generated graph code (an fx node) that raised, and the error's
    first line.

    Example:
        >>> failure("cannot run it", ValueError("bad shape\\nmore"))
        'cannot run it: ValueError: bad shape'
    """
    line = graph_line(exc)
    where = f" at `{line}`" if line else ""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{what}{where}: {type(exc).__name__}: {first}"
