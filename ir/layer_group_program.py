"""The program of a layer-grouped graph (PipeSwitch): group ``k+1``'s weights load while group
``k`` computes.

Per group ``k``, a ``load group k`` piece on the ``load`` stream and a ``group k`` piece on the
``compute`` stream (the group's segment: ``tidal.ir.joint_segments.cut_at_markers``), which
waits for ``load group k`` and ``group k-1``. The loads come first in the program, so they are
all issued at once and stream back to back (one link) while the compute pieces are paced.
A training step's pieces after the groups' forward (``backward``, ``optimizer``) follow on the
compute stream. Every rank runs its own copy: the program has no collective (``world`` 1).

Example:
    >>> run = pipelined([("x", "g0"), ("g1", "y")], [("optimizer", ())])
    >>> [(p.name, p.stream, p.deps, p.kind) for p in run.program.pieces]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('load group 0', 'load', (), 'load'), ('load group 1', 'load', (0,), 'load'),
     ('group 0', 'compute', (0,), 'segment'), ('group 1', 'compute', (1, 2), 'segment'),
     ('optimizer', 'compute', (3,), 'optimizer')]
    >>> run.groups
    (0, 1, 0, 1, None)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tidal.ir.program import COMPUTE, LOAD, OPTIMIZER, Piece, Program

OPTIMIZER_PIECE = "optimizer"
"""The name of the tail piece that steps the optimizer (its kind is ``optimizer``)."""

BACKWARD_PIECE = "backward"
"""The name of the tail piece that runs an eager step's loss and backward."""


@dataclass(frozen=True)
class Pipelined:
    """A pipelined program and, per piece, the layer group it loads or computes (None for
    the pieces after the groups' forward)."""

    program: Program
    groups: tuple[Optional[int], ...]


def pipelined(forward: Sequence[Sequence[str]], tail: Sequence[tuple[str, Sequence[str]]] = (),
              loads: bool = True) -> Pipelined:
    """The program of a grouped graph (see the module docstring): ``group k`` computes
    ``forward[k]`` (node names) after ``load group k`` (when ``loads``) and ``group k-1``;
    each ``(name, nodes)`` of ``tail`` follows on the compute stream, in order."""
    n = len(forward) if loads else 0
    pieces = [Piece(f"load group {k}", LOAD, (k - 1,) if k else ()) for k in range(n)]
    groups: list[Optional[int]] = list(range(n))
    last: Optional[int] = None
    for k, nodes in enumerate(forward):
        deps = ([k] if loads else []) + ([] if last is None else [last])
        pieces.append(Piece(f"group {k}", COMPUTE, tuple(deps), tuple(nodes)))
        groups.append(k)
        last = len(pieces) - 1
    for name, nodes in tail:
        pieces.append(Piece(name, COMPUTE, () if last is None else (last,), tuple(nodes),
                            kind=OPTIMIZER if name == OPTIMIZER_PIECE else ""))
        groups.append(None)
        last = len(pieces) - 1
    return Pipelined(Program(tuple(pieces), world=1), tuple(groups))
