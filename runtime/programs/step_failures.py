"""Failure reporting of a program's step: one clear error, naming where it happened.

A piece that fails makes every later piece of the step fail at once, naming it
(:class:`FailFast`), so no rank waits at a collective for a peer that will not come; a
collective that fails or times out (its group has the world's timeout) becomes one
:class:`PeerFailureError` naming the pass, the piece, the peer rank (when known) and the
group's timeout, the gloo/NCCL error chained (:func:`collective_errors`, and :class:`FailFast`
for a collective a piece runs itself); ranks found a step apart raise
:class:`StepMismatchError` (:func:`check_steps`); an error raised inside generated graph code
is told by the line of the fx node that raised it (:func:`graph_line`, :func:`failure`).

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
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

from tidal.ir.errors import TidalError
from tidal.runtime.peer_failures import is_peer_failure, peer_failure


class StepMismatchError(TidalError, RuntimeError):
    """The ranks reached one collective on different steps (one raised inside a step that the
    script caught, or skipped one): their collectives would pair step k with step k+1. Names
    this rank's step (``step``) and the others' (``steps``: every rank's, in rank order, or
    the lowest and highest)."""

    def __init__(self, message: str, *, step: int, steps: Sequence[int]):
        super().__init__(message)
        self.step, self.steps = step, tuple(steps)


class FailFast:
    """The first failure of one step of ``who``'s program: a piece wrapped by :meth:`wrap`
    runs only while no piece failed."""

    def __init__(self, who: str):
        self.who = who
        self.failed = ""  # 'piece NAME failed: ERROR' once one did

    def wrap(self, name: str, action: Callable[[], Any]) -> Callable[[], Any]:
        """Piece ``name`` doing ``action`` (returning what it returns), guarded (see the class
        docstring); a collective's failure in it becomes a :class:`PeerFailureError` naming
        the piece."""
        def run() -> Any:
            if self.failed:
                raise RuntimeError(f"{self.who}: piece {name!r} not run: {self.failed}")
            try:
                return action()
            except BaseException as e:
                self.failed = f"piece {name!r} failed: {type(e).__name__}: {e}"
                if is_peer_failure(e) and not isinstance(e, StepMismatchError):
                    notes = getattr(e, "__notes__", None) or ["in its collective"]
                    raise peer_failure(self.who, notes[0].removeprefix("in "), e, name)
                raise
        return run


@contextlib.contextmanager
def collective_errors(who: str, what: str) -> Iterator[None]:
    """Turn a failed or timed-out collective ``what`` of pass ``who`` into one
    :class:`PeerFailureError` instead of a deep gloo/NCCL traceback (a piece that runs it
    under :class:`FailFast` adds its name)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, (TidalError, StepMismatchError)) or not is_peer_failure(e):
            raise
        raise peer_failure(who, what, e) from e


def check_steps(who: str, step: int, steps: Sequence[int]) -> None:
    """Raise :class:`StepMismatchError` unless every rank's ``steps`` (in rank order, or the
    lowest and highest) equal this rank's ``step``.

    Example:
        >>> check_steps("compression", 3, [3, 3])
        >>> try:
        ...     check_steps("compression", 3, [3, 4])
        ... except StepMismatchError as e:
        ...     print(e.step, e.steps, str(e)[:71])
        3 (3, 4) compression: the ranks are on different steps: this rank on step 3, the
    """
    steps = [int(s) for s in steps]
    if all(s == step for s in steps):
        return
    raise StepMismatchError(
        f"{who}: the ranks are on different steps: this rank on step {step}, the ranks on "
        f"steps {min(steps)} to {max(steps)} (every rank's, in rank order: {steps}): a rank "
        f"raised inside a step that the script caught, or skipped a step, and every later "
        f"collective would pair one rank's step with another's; end the run on every rank "
        f"(or resume all ranks from one checkpoint)", step=step, steps=steps)


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
