"""A rank's share of a global batch under data parallelism (``tidal.runtime.programs.
data_parallel``, and round_robin's micro-batches): the rows it trains on, cut as
``torch.tensor_split`` cuts (:func:`shard_rows`, :func:`shard`), and the weight that makes
the averaged gradient the global batch's when the rows do not split evenly
(:class:`LocalShard`, :func:`local_shard`).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from tidal.ir.cost import example_batch
from tidal.runtime.programs.step_capture import shape_key


def shard_rows(batch: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the global batch that ``rank`` of ``size`` trains on, cut as
    ``torch.tensor_split`` cuts: the first ``batch % size`` ranks one row more; a rank gets
    none when ``batch < size``.

    Example:
        >>> [shard_rows(7, r, 2) for r in range(2)], shard_rows(1, 1, 2)
        ([(0, 4), (4, 7)], (1, 1))
    """
    per, extra = divmod(batch, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def shard(value: Any, rank: int, size: int, batch: int) -> Any:
    """This rank's slice of dim 0 (:func:`shard_rows`) of every tensor whose dim 0 is the
    global batch.

    Example:
        >>> import torch
        >>> shard((torch.arange(5), "mask"), rank=1, size=2, batch=5)
        (tensor([3, 4]), 'mask')
    """
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        start, stop = shard_rows(batch, rank, size)
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return type(value)(shard(v, rank, size, batch) for v in value)
    if isinstance(value, Mapping):
        return {k: shard(v, rank, size, batch) for k, v in value.items()}
    return value


class LocalShard(NamedTuple):
    """This rank's part of a global batch: the step's cache ``key`` (the global batch's
    shapes: the same on every rank), the ``inputs`` and ``targets`` it trains on and the
    ``weight`` of its gradient and loss before the averaging sync, ``rows * world / batch``
    (None when the batch splits evenly: 1; 0 on a rank with no rows, which trains on the
    batch's first row as a stand-in so that it runs the same program and joins every
    collective with zero gradients)."""

    key: tuple
    inputs: Any
    targets: Any
    weight: Optional[float]


def local_shard(inputs: Any, targets: Any, rank: int, size: int) -> LocalShard:
    """Rank ``rank``'s :class:`LocalShard` of the global batch ``inputs``/``targets``. The
    weights make the synchronized gradient that of the global batch's mean loss, for a
    ``loss_fn`` that averages over rows (the default of ``cross_entropy``/``mse_loss``); a
    sum-reduced loss is not rescaled: it gets the same weights (DDP's plain average when
    the batch splits evenly).

    Example:
        >>> import torch
        >>> x = torch.arange(3.0)
        >>> [(s.targets.tolist(), s.weight) for s in (local_shard((x,), x, r, 2) for r in (0, 1))]
        [([0.0, 1.0], 1.3333333333333333), ([2.0], 0.6666666666666666)]
        >>> local_shard((x,), x, 0, 3).weight is None   # an even split: weight 1
        True
        >>> local_shard((x[:1],), x[:1], 1, 2)[2:]     # no rows: a stand-in row, weight 0
        (tensor([0.]), 0.0)
    """
    batch = example_batch(inputs)
    if batch == 0:
        raise ValueError("data parallel: the global batch has no rows; pass at least one")
    start, stop = shard_rows(batch, rank, size)
    rows = stop - start
    weight = None if rows * size == batch else rows * size / batch
    if rows == 0:
        rank, size = 0, batch          # the first row (the weight 0 cancels it)
    return LocalShard(shape_key(inputs, targets), shard(inputs, rank, size, batch),
                      shard(targets, rank, size, batch), weight)
