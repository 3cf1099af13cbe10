"""Recommendation models: DLRM and DeepFM over dense features and one categorical id per table.

Both take ``forward(dense, sparse)`` with ``dense`` float ``[B, num_dense]`` and ``sparse``
int64 ``[B, num_tables]`` (column ``t`` holds the id looked up in table ``t``) and return one
click logit per sample, ``[B]``. Every embedding table is its own module, named ``tables.<t>``
(and ``linear.<t>`` for DeepFM's 1-wide tables of the linear part), so a graph pass finds each
lookup as one ``call_module`` node whose ids come straight from ``sparse``.

- :class:`DLRM` (Naumov et al., 2019): a bottom MLP maps the dense features to an embedding-sized
  vector; one ``nn.EmbeddingBag(mode="sum")`` per table looks up bags of one id
  (``sparse[:, t:t+1]``); the pairwise dot products of all ``T + 1`` vectors (strictly lower
  triangle, DLRM's ``tril_indices(offset=-1)`` order) are concatenated to the bottom output and
  fed to the top MLP, whose last layer gives the logit. :func:`dlrm` has Table 5.2's dense layers
  (2,962,289 dense parameters at dimension 48).
- :class:`DeepFM` (Guo et al., 2017, with the usual handling of dense features): logit =
  linear part (a 1-wide ``nn.Embedding`` per table + a linear map of the dense features) +
  FM second-order term over the ``T`` embeddings + a deep MLP over the concatenated embeddings
  and dense features. :func:`deepfm` has Table 5.2's deep layers (1248-64-64-64).

The ``*_small`` variants (8 tables of 100-1000 rows, dimension 8) train in milliseconds; the full
ones have 26 tables like Criteo with 10^4..10^5 rows each (:data:`CRITEO_LIKE_ROWS`).

Example:
    >>> import torch
    >>> from examples.models.recsys import dlrm_small
    >>> _ = torch.manual_seed(0)
    >>> model = dlrm_small()
    >>> dense, sparse = model.example_inputs(4)
    >>> dense.shape, sparse.shape, sparse.dtype
    (torch.Size([4, 4]), torch.Size([4, 8]), torch.int64)
    >>> logits = model(dense, sparse)
    >>> logits.shape
    torch.Size([4])
    >>> model.default_loss(logits, model.example_targets(4)).backward()
    >>> model.tables[0].weight.grad.shape
    torch.Size([100, 8])
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .example_io import module_device, seeded_generator

CRITEO_NUM_DENSE = 13
"""Number of dense (integer) features in a Criteo record."""

CRITEO_LIKE_ROWS: tuple[int, ...] = tuple(round(10 ** (4 + t / 25)) for t in range(26))
"""Rows of the full models' 26 tables: geometrically spaced from 10,000 to 100,000."""

SMALL_ROWS: tuple[int, ...] = (100, 200, 300, 400, 500, 600, 800, 1000)
"""Rows of the small models' 8 tables."""


def _check_sizes(model: str, num_dense: int, table_rows: Sequence[int], dim: int) -> None:
    """Raise a one-line ValueError naming the bad argument of ``model``'s constructor."""
    if num_dense < 1:
        raise ValueError(f"{model}: num_dense must be >= 1, got {num_dense}")
    if len(table_rows) < 1:
        raise ValueError(f"{model}: table_rows must name at least one table")
    bad = [(t, r) for t, r in enumerate(table_rows) if int(r) < 1]
    if bad:
        raise ValueError(f"{model}: table_rows[{bad[0][0]}] must be >= 1, got {bad[0][1]}")
    if dim < 1:
        raise ValueError(f"{model}: dim must be >= 1, got {dim}")


def mlp(sizes: Sequence[int], final_relu: bool) -> nn.Sequential:
    """``Linear`` layers through ``sizes`` (``sizes[0]`` inputs), ReLU between them.

    With ``final_relu`` a ReLU also follows the last layer. Weights are drawn as in DLRM:
    N(0, sqrt(2 / (fan_in + fan_out))), biases N(0, sqrt(1 / fan_out)).
    """
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out))
        layers.append(linear)
        if final_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _init_table_(table: nn.Module) -> nn.Module:
    """DLRM's embedding initialisation: uniform in +-sqrt(1 / num_rows)."""
    bound = math.sqrt(1.0 / table.weight.shape[0])
    with torch.no_grad():
        table.weight.uniform_(-bound, bound)
    return table


def _float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (float32 if none)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def click_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Binary cross entropy of logits ``[B]`` against 0/1 labels ``[B]`` (same float dtype)."""
    return F.binary_cross_entropy_with_logits(outputs, targets)


class RecsysIO:
    """Mixin for click models; needs ``num_dense`` and ``table_rows`` attributes.

    Example inputs are uniform: dense features in [0, 1), ids uniform in each table. They take
    the float dtype and device of the model's parameters (so ``.double()`` models get float64).
    """

    num_dense: int
    table_rows: tuple[int, ...]

    def example_inputs(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """Return ``(dense [B, num_dense], sparse [B, num_tables] int64)``."""
        generator = seeded_generator()
        dense = torch.rand(batch_size, self.num_dense, generator=generator)
        rows = torch.tensor(self.table_rows, dtype=torch.float64)
        uniform = torch.rand(batch_size, len(self.table_rows), generator=generator,
                             dtype=torch.float64)
        sparse = torch.minimum((uniform * rows).long(), (rows - 1).long())
        device = module_device(self)
        return dense.to(device, _float_dtype(self)), sparse.to(device)

    def example_targets(self, batch_size: int) -> Tensor:
        """Return 0/1 click labels ``[B]`` in the model's float dtype."""
        half = torch.full((batch_size,), 0.5, dtype=torch.float64)
        labels = torch.bernoulli(half, generator=seeded_generator(1))
        return labels.to(module_device(self), _float_dtype(self))

    default_loss = staticmethod(click_loss)


class DLRM(RecsysIO, nn.Module):
    """DLRM: bottom MLP, one sum-``EmbeddingBag`` per table, dot interaction, top MLP.

    Args:
        num_dense: dense features per sample.
        table_rows: rows of each embedding table (one table per column of ``sparse``).
        dim: embedding dimension (also the bottom MLP's output width).
        bottom_mlp: hidden widths of the bottom MLP (a final ``dim``-wide layer is appended).
        top_mlp: hidden widths of the top MLP (a final 1-wide logit layer is appended).
    """

    def __init__(self, num_dense: int, table_rows: Sequence[int], dim: int,
                 bottom_mlp: Sequence[int] = (), top_mlp: Sequence[int] = ()) -> None:
        super().__init__()
        _check_sizes("DLRM", num_dense, table_rows, dim)
        self.num_dense = int(num_dense)
        self.table_rows = tuple(int(r) for r in table_rows)
        self.dim = int(dim)
        num_vectors = len(self.table_rows) + 1
        self.bottom = mlp([self.num_dense, *bottom_mlp, self.dim], final_relu=True)
        self.tables = nn.ModuleList(
            _init_table_(nn.EmbeddingBag(rows, self.dim, mode="sum")) for rows in self.table_rows
        )
        row, col = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        self.register_buffer("pair_index", row * num_vectors + col, persistent=False)
        num_pairs = num_vectors * (num_vectors - 1) // 2
        self.top = mlp([self.dim + num_pairs, *top_mlp, 1], final_relu=False)

    @property
    def num_tables(self) -> int:
        """Number of embedding tables (columns of ``sparse``)."""
        return len(self.table_rows)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """Click logits ``[B]`` for ``dense [B, num_dense]`` and ``sparse [B, num_tables]``."""
        x = self.bottom(dense)
        vectors = [x]
        for t, table in enumerate(self.tables):
            vectors.append(table(sparse[:, t:t + 1]))
        stacked = torch.stack(vectors, dim=1)
        products = torch.bmm(stacked, stacked.transpose(1, 2))
        pairs = products.flatten(1).index_select(1, self.pair_index)
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


class DeepFM(RecsysIO, nn.Module):
    """DeepFM: linear part + FM second-order term + deep MLP, one ``nn.Embedding`` per table.

    Args:
        num_dense: dense features per sample (they enter the linear part and the deep MLP).
        table_rows: rows of each embedding table (one table per column of ``sparse``).
        dim: embedding dimension.
        deep_mlp: hidden widths of the deep MLP (a final 1-wide layer is appended).
    """

    def __init__(self, num_dense: int, table_rows: Sequence[int], dim: int,
                 deep_mlp: Sequence[int] = ()) -> None:
        super().__init__()
        _check_sizes("DeepFM", num_dense, table_rows, dim)
        self.num_dense = int(num_dense)
        self.table_rows = tuple(int(r) for r in table_rows)
        self.dim = int(dim)
        self.tables = nn.ModuleList(
            _init_table_(nn.Embedding(rows, self.dim)) for rows in self.table_rows
        )
        self.linear = nn.ModuleList(
            _init_table_(nn.Embedding(rows, 1)) for rows in self.table_rows
        )
        self.dense_linear = nn.Linear(self.num_dense, 1)
        deep_in = len(self.table_rows) * self.dim + self.num_dense
        self.deep = mlp([deep_in, *deep_mlp, 1], final_relu=False)

    @property
    def num_tables(self) -> int:
        """Number of embedding tables (columns of ``sparse``)."""
        return len(self.table_rows)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """Click logits ``[B]`` for ``dense [B, num_dense]`` and ``sparse [B, num_tables]``."""
        embeddings = []
        linear = self.dense_linear(dense)
        for t, (table, weight) in enumerate(zip(self.tables, self.linear)):
            ids = sparse[:, t]
            embeddings.append(table(ids))
            linear = linear + weight(ids)
        stacked = torch.stack(embeddings, dim=1)
        summed = stacked.sum(dim=1)
        fm = 0.5 * (summed * summed - (stacked * stacked).sum(dim=1)).sum(dim=1)
        deep = self.deep(torch.cat([stacked.flatten(1), dense], dim=1))
        return linear.squeeze(1) + fm + deep.squeeze(1)


def dlrm(table_rows: Sequence[int] = CRITEO_LIKE_ROWS, dim: int = 48) -> DLRM:
    """Table 5.2's DLRM: bottom 13-512-256-64-48, top 1024-1024-1024-256-128-1, 26 tables.

    2,962,289 dense parameters at ``dim=48``; the tables hold ``sum(table_rows) * dim``
    (about 49 M) more.
    """
    return DLRM(CRITEO_NUM_DENSE, table_rows, dim, bottom_mlp=(512, 256, 64),
                top_mlp=(1024, 1024, 1024, 256, 128))


def dlrm_small(table_rows: Sequence[int] = SMALL_ROWS, dim: int = 8) -> DLRM:
    """A tiny DLRM: 4 dense features, 8 tables of 100-1000 rows, bottom 4-16-8, top 44-32-16-1."""
    return DLRM(4, table_rows, dim, bottom_mlp=(16,), top_mlp=(32, 16))


def deepfm(table_rows: Sequence[int] = CRITEO_LIKE_ROWS, dim: int = 48) -> DeepFM:
    """Table 5.2's DeepFM: 26 tables of dimension 48, deep MLP (1248 + 13)-64-64-64-1."""
    return DeepFM(CRITEO_NUM_DENSE, table_rows, dim, deep_mlp=(64, 64, 64))


def deepfm_small(table_rows: Sequence[int] = SMALL_ROWS, dim: int = 8) -> DeepFM:
    """A tiny DeepFM: 4 dense features, 8 tables of 100-1000 rows, deep MLP (64 + 4)-32-32-1."""
    return DeepFM(4, table_rows, dim, deep_mlp=(32, 32))
