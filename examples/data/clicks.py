"""Synthetic click logs: dense features, Zipf-skewed categorical ids and learnable 0/1 labels.

:class:`ClickData` stands in for a Criteo-like data set when the real one is not at hand. Batch
``i`` is a pure function of ``(seed, i)``, so any batch can be regenerated at any time, in any
order, on any process: what a lookahead cache (Bagpipe's Oracle Cacher) needs to read the ids of
future batches.

- **Ids.** In each table, rank ``r`` (0-based) is drawn with probability proportional to
  ``1 / (r + 1) ** alpha`` (Zipf), by inverse-CDF sampling (``torch.searchsorted`` on the
  cumulative probabilities, computed once per table); ranks map to ids through a seeded
  permutation, so the popular ids are scattered over the table. With ``hot_fraction`` and
  ``hot_share`` the skew is set directly instead: ``hot_fraction`` of the ids (at least one)
  receive ``hot_share`` of the accesses, uniformly within the hot and within the cold ids
  (``hot_share=0.9`` is the dissertation's skewed case, ``0.01`` its "no skew" one).
- **Dense features.** ``log(1 + x)`` of exponential counts ``x`` with mean 4 (Criteo's dense
  features are log-transformed counts too).
- **Labels.** A fixed seeded linear function of the features (a weight per dense feature and a
  weight per id of every table), through a sigmoid, Bernoulli-sampled: a model can learn them.

Example:
    >>> from examples.data.clicks import ClickData
    >>> data = ClickData(num_dense=4, table_rows=(100, 1000), batch_size=8, alpha=1.2)
    >>> (dense, sparse), labels = data.batch(0)
    >>> dense.shape, dense.dtype, sparse.shape, sparse.dtype, labels.shape
    (torch.Size([8, 4]), torch.float32, torch.Size([8, 2]), torch.int64, torch.Size([8]))
    >>> bool((sparse[:, 1] < 1000).all()), set(labels.tolist()) <= {0.0, 1.0}
    (True, True)
    >>> data.batch(0)[0][1].equal(sparse)
    True
    >>> skewed = ClickData(4, (1000,), 8, hot_fraction=0.01, hot_share=0.9)
    >>> round(float(skewed.id_probabilities(0).topk(10).values.sum()), 6)
    0.9
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

DENSE_MEAN_COUNT = 4.0
"""Mean of the exponential counts behind the dense features."""

DENSE_FEATURE_MEAN = 1.3408854448313932
"""Expected dense feature, ``E[log(1 + x)] = exp(1/4) * E1(1/4)`` for ``x`` exponential with
mean 4; the label function centres the dense features on it."""

LABEL_BIAS = -1.0
"""Bias of the label logit (about a third of the samples are clicks)."""


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that is a fixed function of ``parts`` (stable across runs and processes)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def seeded(*parts: object) -> torch.Generator:
    """A CPU generator seeded with :func:`derived_seed` of ``parts``."""
    generator = torch.Generator()
    generator.manual_seed(derived_seed(*parts))
    return generator


def zipf_weights(rows: int, alpha: float) -> Tensor:
    """Unnormalised Zipf weights ``1 / (r + 1) ** alpha`` for ranks ``0..rows-1`` (float64)."""
    return torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)


def hot_cold_weights(rows: int, hot_fraction: float, hot_share: float) -> Tensor:
    """Per-rank probabilities: the first ``hot_count(rows, hot_fraction)`` ranks share
    ``hot_share`` uniformly, the others share ``1 - hot_share`` uniformly (float64)."""
    hot = hot_count(rows, hot_fraction)
    weights = torch.full((rows,), (1.0 - hot_share) / (rows - hot), dtype=torch.float64)
    weights[:hot] = hot_share / hot
    return weights


def hot_count(rows: int, hot_fraction: float) -> int:
    """Number of hot ids in a table of ``rows`` ids: ``round(hot_fraction * rows)``, kept within
    ``[1, rows - 1]``."""
    return min(max(1, round(hot_fraction * rows)), rows - 1)


def _check(num_dense: int, table_rows: Sequence[int], batch_size: int, alpha: float,
           hot_fraction: Optional[float], hot_share: Optional[float]) -> None:
    """Raise a one-line ValueError naming the first bad :class:`ClickData` argument."""
    if num_dense < 1:
        raise ValueError(f"ClickData: num_dense must be >= 1, got {num_dense}")
    if len(table_rows) < 1:
        raise ValueError("ClickData: table_rows must name at least one table")
    for t, rows in enumerate(table_rows):
        if int(rows) < 1:
            raise ValueError(f"ClickData: table_rows[{t}] must be >= 1, got {rows}")
    if batch_size < 1:
        raise ValueError(f"ClickData: batch_size must be >= 1, got {batch_size}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"ClickData: alpha must be a finite number > 0, got {alpha}")
    if (hot_fraction is None) != (hot_share is None):
        raise ValueError("ClickData: hot_fraction and hot_share must be given together, "
                         f"got hot_fraction={hot_fraction}, hot_share={hot_share}")
    if hot_fraction is None:
        return
    if not 0.0 < hot_fraction < 1.0:
        raise ValueError(f"ClickData: hot_fraction must be in (0, 1), got {hot_fraction}")
    if not 0.0 < hot_share < 1.0:
        raise ValueError(f"ClickData: hot_share must be in (0, 1), got {hot_share}")
    for t, rows in enumerate(table_rows):
        if int(rows) < 2:
            raise ValueError(f"ClickData: table_rows[{t}] = {rows} cannot be split into hot and "
                             "cold ids (hot_fraction needs at least 2 rows)")


class ClickData:
    """Deterministic synthetic click batches (see the module docstring for the distributions).

    Args:
        num_dense: dense features per sample.
        table_rows: ids of each categorical feature (one table per column of ``sparse``).
        batch_size: samples per batch.
        alpha: Zipf exponent (> 0; larger is more skewed); unused with ``hot_fraction``.
        hot_fraction: fraction of each table's ids that are hot, in (0, 1).
        hot_share: fraction of the accesses that fall on hot ids, in (0, 1).
        seed: fixes the id permutations, the label function and every batch.

    Per table it keeps the cumulative rank probabilities, the rank-to-id permutation and
    the label weights: 24 bytes per row.
    """

    def __init__(self, num_dense: int, table_rows: Sequence[int], batch_size: int,
                 alpha: float = 1.0, hot_fraction: Optional[float] = None,
                 hot_share: Optional[float] = None, seed: int = 0) -> None:
        _check(num_dense, table_rows, batch_size, alpha, hot_fraction, hot_share)
        self.num_dense = int(num_dense)
        self.table_rows = tuple(int(r) for r in table_rows)
        self.batch_size = int(batch_size)
        self.alpha = float(alpha)
        self.hot_fraction = hot_fraction
        self.hot_share = hot_share
        self.seed = int(seed)
        self._cdfs = tuple(self._cdf(rows) for rows in self.table_rows)
        self._ids_of_rank = tuple(
            torch.randperm(rows, generator=seeded(self.seed, "permutation", t))
            for t, rows in enumerate(self.table_rows)
        )
        labels = seeded(self.seed, "labels")
        self._dense_weight = torch.randn(self.num_dense, generator=labels,
                                         dtype=torch.float64) / math.sqrt(self.num_dense)
        scale = 1.0 / math.sqrt(self.num_tables)
        self._id_weights = tuple(
            torch.randn(rows, generator=labels, dtype=torch.float64) * scale
            for rows in self.table_rows
        )

    @property
    def num_tables(self) -> int:
        """Number of categorical features (columns of ``sparse``)."""
        return len(self.table_rows)

    def _cdf(self, rows: int) -> Tensor:
        """Cumulative rank probabilities of one table; the last entry is exactly 1."""
        if self.hot_fraction is None:
            weights = zipf_weights(rows, self.alpha)
        else:
            weights = hot_cold_weights(rows, self.hot_fraction, self.hot_share)
        cdf = weights.cumsum(0)
        cdf /= cdf[-1].clone()
        cdf[-1] = 1.0
        return cdf

    def id_probabilities(self, table: int) -> Tensor:
        """Probability of each id of ``table`` (float64, ``[table_rows[table]]``, sums to 1)."""
        if not 0 <= table < self.num_tables:
            raise IndexError(f"ClickData: table {table} out of range for {self.num_tables} tables")
        cdf = self._cdfs[table]
        by_rank = torch.diff(cdf, prepend=cdf.new_zeros(1))
        probabilities = torch.empty_like(by_rank)
        probabilities[self._ids_of_rank[table]] = by_rank
        return probabilities

    def batch(self, i: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """Batch ``i`` (any ``i >= 0``) as ``((dense, sparse), labels)``.

        ``dense`` is float32 ``[B, num_dense]``, ``sparse`` int64 ``[B, num_tables]``, ``labels``
        float32 0/1 ``[B]``. The same ``(seed, i)`` always gives the same tensors.
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"ClickData.batch: i must be an int >= 0, got {i!r}")
        generator = seeded(self.seed, "batch", i)
        counts = torch.empty(self.batch_size, self.num_dense, dtype=torch.float64)
        counts.exponential_(1.0 / DENSE_MEAN_COUNT, generator=generator)
        dense = counts.log1p()
        uniform = torch.rand(self.num_tables, self.batch_size, generator=generator,
                             dtype=torch.float64)
        columns = []
        logit = (dense - DENSE_FEATURE_MEAN) @ self._dense_weight + LABEL_BIAS
        for t, rows in enumerate(self.table_rows):
            rank = torch.searchsorted(self._cdfs[t], uniform[t], right=True)
            ids = self._ids_of_rank[t][rank.clamp_(max=rows - 1)]
            logit += self._id_weights[t][ids]
            columns.append(ids)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
        return (dense.float(), torch.stack(columns, dim=1)), labels.float()
