"""How a burst plan's layers split a global batch of any size: the one split rule the planner,
the pass and the runtime use (pure: no process group, no tensors).

A burst plan is made for one global batch ``B``: each layer runs on ``g`` ranks, part ``j`` of
``B`` cut in ``g`` going to its ``j``-th rank (:func:`split_rows`, as ``torch.tensor_split``
cuts: the first ``B % g`` parts get one row more). A step on another global batch ``B'`` (a
last, smaller batch of an epoch) keeps the plan's structure — each layer on the same ranks, each
rank the same *part* — and cuts ``B'`` the same way; a rank's part may be empty (``B' < g``).
So what the plan records per rank is a :data:`Share`, ``(part, parts)``: part ``part`` of the
batch cut in ``parts`` (:data:`ALL`: every row; :data:`NONE`: no row), and
:meth:`TransferRows.layouts` gives a ``tidal::scatter``/``gather``'s row layouts
(``tidal.ir.collectives``) for any batch.

Example:
    >>> split_rows(7, 2), split_rows(1, 2)
    (((0, 4), (4, 7)), ((0, 1), (1, 1)))
    >>> move = TransferRows(src=(ALL, ALL), dst=((0, 2), (1, 2)))   # scatter to two ranks
    >>> move.layouts(8), move.layouts(7)
    (([0, 8, 0, 8], [0, 4, 4, 8]), ([0, 7, 0, 7], [0, 4, 4, 7]))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Share = tuple[int, int]
"""``(part, parts)``: part ``part`` of a batch cut in ``parts`` (:func:`split_rows`)."""
ALL: Share = (0, 1)
"""Every row of the batch (a model input, the gathered output)."""
NONE: Share = (0, 0)
"""No row (a rank outside the layer's set)."""

Rows = tuple[tuple[int, int], ...]


def split_rows(batch: int, parts: int) -> Rows:
    """``[lo, hi)`` of each of ``parts`` consecutive parts of ``batch`` rows, as
    ``torch.tensor_split(x, parts)`` cuts them: the first ``batch % parts`` parts get one row
    more; with ``batch < parts`` the last ones are empty.

    >>> split_rows(8, 3)
    ((0, 3), (3, 6), (6, 8))
    """
    if parts < 1 or batch < 0:
        raise ValueError(f"split_rows(batch={batch}, parts={parts}): need batch >= 0, parts >= 1")
    q, r = divmod(batch, parts)
    out, lo = [], 0
    for k in range(parts):
        hi = lo + q + (1 if k < r else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def share_rows(share: Share, batch: int) -> tuple[int, int]:
    """The ``[lo, hi)`` rows of ``batch`` that ``share`` holds.

    >>> share_rows((1, 2), 7), share_rows(NONE, 7), share_rows(ALL, 7)
    ((4, 7), (0, 0), (0, 7))
    """
    part, parts = share
    if parts == 0:
        return (0, 0)
    if not 0 <= part < parts:
        raise ValueError(f"share_rows: part {part} of {parts} does not exist")
    return split_rows(batch, parts)[part]


def placement_shares(ranks: Sequence[int], ranges: Sequence[tuple[int, int]],
                     world: int) -> tuple[Share, ...]:
    """Per rank of ``world``, its :data:`Share` of a layer placed on ``ranks`` with sample
    ``ranges`` (the plan's, one per rank, contiguous): the ``j``-th range from the batch's
    start is part ``j``; a rank outside ``ranks`` holds :data:`NONE`.

    >>> placement_shares((2, 0), ((4, 8), (0, 4)), 3)
    ((0, 2), (0, 0), (1, 2))
    """
    if len(ranks) != len(ranges):
        raise ValueError(f"placement_shares: {len(ranks)} ranks but {len(ranges)} ranges")
    order = sorted(range(len(ranks)), key=lambda k: (ranges[k][0], ranges[k][1], k))
    out = [NONE] * world
    for part, k in enumerate(order):
        out[ranks[k]] = (part, len(ranks))
    return tuple(out)


@dataclass(frozen=True)
class TransferRows:
    """What a ``tidal::scatter``/``gather`` (or a ``rows_like`` stand-in) moves, for any global
    batch: per rank its :data:`Share` before (``src``) and after (``dst``); ``factor`` rows of
    the value per sample (a folded value); ``whole`` > 0 for a value with no sample dimension 0
    (the output of a layer pinned to one GPU): a rank that holds it holds all its ``whole``
    rows, whatever the batch. ``burst_parallel`` records one on each node it inserts
    (``tidal.ir.meta.get_pass_meta(node, "burst_parallel")``)."""

    src: tuple[Share, ...]
    dst: tuple[Share, ...]
    factor: int = 1
    whole: int = 0

    def layout(self, shares: Sequence[Share], batch: int) -> list[int]:
        """The flat layout (``tidal.ir.collectives.layout``) of ``shares`` at ``batch``."""
        out: list[int] = []
        for share in shares:
            if self.whole:
                out += [0, self.whole if share != NONE else 0]
            else:
                lo, hi = share_rows(share, batch)
                out += [lo * self.factor, hi * self.factor]
        return out

    def layouts(self, batch: int) -> tuple[list[int], list[int]]:
        """``(src, dst)`` layouts of the transfer on a global batch of ``batch`` samples."""
        return self.layout(self.src, batch), self.layout(self.dst, batch)
