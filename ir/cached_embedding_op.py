"""``tidal::cached_embedding``: an embedding lookup that reads a working set, not the table.

Bagpipe (dissertation ch. 5) keeps the embedding tables on embedding servers; a trainer only
holds the rows a batch touches. This op computes what the original ``nn.Embedding`` /
``nn.EmbeddingBag`` call computes, from ``rows`` alone: row ``i`` of ``rows`` is the embedding
of id ``unique_ids[i]`` (``unique_ids``: int64, 1-D, sorted ascending, distinct). Each id is
mapped to its position in ``unique_ids`` (a strictly increasing map, so every sort and every
accumulation order inside the aten kernels is the one the full table sees) and the same aten
kernel runs on ``rows``: outputs are the original module's bit for bit, and the gradient with
respect to ``rows`` equals, bit for bit, the corresponding rows of the full table's gradient
(``padding_idx`` rows get none, as in eager).

Arguments: ``table`` (the module path, for messages), ``unique_ids``, ``rows`` ``[n, dim]``,
``ids`` (int64 or int32, the shape the module took), ``offsets`` and ``per_sample_weights``
(``nn.EmbeddingBag``'s, or None) and ``bag_mode`` (``""`` for ``nn.Embedding``; ``"sum"``,
``"mean"`` or ``"max"``), then the module's ``padding_idx`` (None or a table row),
``include_last_offset`` and ``scale_grad_by_freq``. It is differentiable with respect to
``rows`` and ``per_sample_weights``; its backward is the op ``tidal::cached_embedding_backward``
(opaque with a fake kernel, so ``make_fx`` captures a training step through both). A missing
working set (``rows`` or ``unique_ids`` None) or an id missing from ``unique_ids`` is a
``ValueError`` naming the table.

Example:
    >>> import torch
    >>> from tidal.ir import cached_embedding_op  # registers the op
    >>> table = torch.arange(20.0).reshape(10, 2)
    >>> ids = torch.tensor([[7, 3], [3, 3]])
    >>> unique = torch.unique(ids)
    >>> out = torch.ops.tidal.cached_embedding("emb", unique, table[unique], ids, None, None, "")
    >>> torch.equal(out, torch.nn.functional.embedding(ids, table))
    True
    >>> torch.ops.tidal.cached_embedding("emb", unique, table[unique], torch.tensor([5]), None,
    ...                                  None, "")
    Traceback (most recent call last):
    ...
    ValueError: tidal::cached_embedding: table 'emb': id 5 is not in its working set (2 ids: 3 .. 7)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

BAG_MODES = ("", "sum", "mean", "max")
"""``bag_mode`` values: ``""`` for ``nn.Embedding``, else ``nn.EmbeddingBag``'s mode."""

_MODE_CODE = {"sum": 0, "mean": 1, "max": 2}  # aten's EmbeddingBagMode


def _where(table: str) -> str:
    return f"tidal::cached_embedding: table {table!r}"


def _check(table: str, unique_ids: Optional[torch.Tensor], rows: Optional[torch.Tensor],
           ids: torch.Tensor, offsets: Optional[torch.Tensor], bag_mode: str) -> None:
    """Shapes and dtypes (what a fake kernel can check); ``ValueError`` naming the table."""
    if unique_ids is None or rows is None:
        missing = "unique_ids" if unique_ids is None else "rows"
        raise ValueError(f"{_where(table)}: no working set ({missing} is None): the table lives "
                         f"on the embedding servers; call the graph module with the keyword "
                         f"inputs the embedding_cache plan names for it (CachedTable.ids_input "
                         f"and .rows_input), e.g. from tidal.ir.plans.embedding_cache."
                         f"working_set(plan, ids, weights)")
    if bag_mode not in BAG_MODES:
        raise ValueError(f"{_where(table)}: bag_mode {bag_mode!r} is not one of {BAG_MODES}")
    if unique_ids.dim() != 1 or unique_ids.dtype != torch.int64:
        raise ValueError(f"{_where(table)}: unique_ids must be a 1-D int64 tensor, got "
                         f"{unique_ids.dtype} of shape {tuple(unique_ids.shape)}")
    if rows.dim() != 2 or rows.shape[0] != unique_ids.shape[0]:
        raise ValueError(f"{_where(table)}: rows must be [len(unique_ids), dim] = "
                         f"[{unique_ids.shape[0]}, dim], got {tuple(rows.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{_where(table)}: ids must be int64 or int32, got {ids.dtype}")
    if bag_mode and offsets is None and ids.dim() != 2:
        raise ValueError(f"{_where(table)}: an embedding bag without offsets takes 2-D ids "
                         f"[bags, ids per bag], got shape {tuple(ids.shape)}")
    if bag_mode and offsets is not None and ids.dim() != 1:
        raise ValueError(f"{_where(table)}: an embedding bag with offsets takes 1-D ids, got "
                         f"shape {tuple(ids.shape)}")


def _local(table: str, unique_ids: torch.Tensor, ids: torch.Tensor, check: bool = True
           ) -> torch.Tensor:
    """Each id's position in ``unique_ids`` (int64, ``ids``' shape); with ``check``, a
    ``ValueError`` naming the first id not in ``unique_ids`` (or unsorted ``unique_ids``)."""
    ids64 = ids.to(torch.int64).contiguous()
    unique_ids = unique_ids.contiguous()
    n = unique_ids.shape[0]
    if check and n > 1 and not bool((unique_ids[1:] > unique_ids[:-1]).all()):
        raise ValueError(f"{_where(table)}: unique_ids must be sorted ascending and distinct "
                         f"(torch.unique(ids, sorted=True))")
    if n == 0:
        if check and ids64.numel():
            raise ValueError(f"{_where(table)}: id {int(ids64.reshape(-1)[0])} is not in its "
                             f"working set (it is empty)")
        return torch.zeros_like(ids64)
    pos = torch.searchsorted(unique_ids, ids64).clamp_(max=n - 1)
    if check:
        bad = unique_ids[pos] != ids64
        if bool(bad.any()):
            first = int(ids64[bad][0])
            raise ValueError(f"{_where(table)}: id {first} is not in its working set ({n} ids: "
                             f"{int(unique_ids[0])} .. {int(unique_ids[-1])})")
    return pos


def _local_padding(unique_ids: torch.Tensor, padding_idx: Optional[int]) -> Optional[int]:
    """The position of ``padding_idx`` in ``unique_ids`` (None if it is not there)."""
    if padding_idx is None or unique_ids.numel() == 0:
        return None
    unique_ids = unique_ids.contiguous()
    pos = int(torch.searchsorted(unique_ids, unique_ids.new_tensor([padding_idx]))[0])
    return pos if pos < unique_ids.shape[0] and int(unique_ids[pos]) == padding_idx else None


def _flat_bags(local: torch.Tensor, offsets: Optional[torch.Tensor],
               per_sample_weights: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """1-D ids, offsets and weights as ``F.embedding_bag`` hands them to aten."""
    if offsets is not None:
        return local, offsets.to(torch.int64), per_sample_weights
    flat_w = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    offs = torch.arange(0, local.numel(), local.shape[1], dtype=torch.int64, device=local.device)
    return local.reshape(-1), offs, flat_w


@torch.library.custom_op("tidal::cached_embedding", mutates_args=())
def cached_embedding(table: str, unique_ids: Optional[torch.Tensor], rows: Optional[torch.Tensor],
                     ids: torch.Tensor, offsets: Optional[torch.Tensor],
                     per_sample_weights: Optional[torch.Tensor], bag_mode: str,
                     padding_idx: Optional[int] = None, include_last_offset: bool = False,
                     scale_grad_by_freq: bool = False) -> torch.Tensor:
    """See the module docstring: the original module's output, computed from ``rows``."""
    _check(table, unique_ids, rows, ids, offsets, bag_mode)
    local = _local(table, unique_ids, ids)
    pad = _local_padding(unique_ids, padding_idx)
    if not bag_mode:
        return F.embedding(local, rows, padding_idx=pad, scale_grad_by_freq=scale_grad_by_freq)
    return F.embedding_bag(local, rows, offsets, mode=bag_mode,
                           per_sample_weights=per_sample_weights,
                           include_last_offset=include_last_offset, padding_idx=pad,
                           scale_grad_by_freq=scale_grad_by_freq)


@cached_embedding.register_fake
def _cached_embedding_fake(table, unique_ids, rows, ids, offsets, per_sample_weights, bag_mode,
                           padding_idx=None, include_last_offset=False,
                           scale_grad_by_freq=False):
    _check(table, unique_ids, rows, ids, offsets, bag_mode)
    dim = rows.shape[1]
    if not bag_mode:
        return rows.new_empty(tuple(ids.shape) + (dim,))
    if offsets is None:
        return rows.new_empty((ids.shape[0], dim))
    return rows.new_empty((offsets.shape[0] - (1 if include_last_offset else 0), dim))


@torch.library.custom_op("tidal::cached_embedding_backward", mutates_args=())
def cached_embedding_backward(grad: torch.Tensor, table: str, unique_ids: torch.Tensor,
                              rows: torch.Tensor, ids: torch.Tensor,
                              offsets: Optional[torch.Tensor],
                              per_sample_weights: Optional[torch.Tensor], bag_mode: str,
                              padding_idx: Optional[int], include_last_offset: bool,
                              scale_grad_by_freq: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``tidal::cached_embedding`` with respect to ``rows`` and
    ``per_sample_weights`` (an empty tensor when there are none), computed by the aten
    backward kernels eager autograd runs for the original module, on the working set."""
    local = _local(table, unique_ids, ids, check=False)
    pad = _local_padding(unique_ids, padding_idx)
    n = rows.shape[0]
    no_weights = rows.new_empty(0)
    if not bag_mode:
        g = torch.ops.aten.embedding_dense_backward(grad, local, n, -1 if pad is None else pad,
                                                    scale_grad_by_freq)
        return g, no_weights
    flat, offs, weights = _flat_bags(local, offsets, per_sample_weights)
    mode = _MODE_CODE[bag_mode]
    aten_pad = -1 if pad is None else pad
    _, offset2bag, bag_size, max_indices = torch.ops.aten._embedding_bag(
        rows, flat, offs, scale_grad_by_freq, mode, False, weights, include_last_offset,
        aten_pad)
    g = torch.ops.aten._embedding_bag_backward(grad, flat, offs, offset2bag, bag_size,
                                               max_indices, n, scale_grad_by_freq, mode, False,
                                               weights, aten_pad)
    if per_sample_weights is None:
        return g, no_weights
    gw = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad, rows, flat, offs, offset2bag, mode, aten_pad)
    return g, gw.reshape(per_sample_weights.shape)


@cached_embedding_backward.register_fake
def _cached_embedding_backward_fake(grad, table, unique_ids, rows, ids, offsets,
                                    per_sample_weights, bag_mode, padding_idx,
                                    include_last_offset, scale_grad_by_freq):
    weights = rows.new_empty(0) if per_sample_weights is None else \
        per_sample_weights.new_empty(per_sample_weights.shape)
    return rows.new_empty(rows.shape), weights


def _setup(ctx, inputs, output) -> None:
    (ctx.table, ctx.unique_ids, rows, ctx.ids, ctx.offsets, ctx.weights, ctx.bag_mode,
     ctx.padding_idx, ctx.include_last_offset, ctx.scale_grad_by_freq) = inputs
    ctx.save_for_backward(rows)


def _backward(ctx, grad):
    (rows,) = ctx.saved_tensors
    g_rows, g_weights = torch.ops.tidal.cached_embedding_backward(
        grad.contiguous(), ctx.table, ctx.unique_ids, rows, ctx.ids, ctx.offsets, ctx.weights,
        ctx.bag_mode, ctx.padding_idx, ctx.include_last_offset, ctx.scale_grad_by_freq)
    return (None, None, g_rows, None, None, None if ctx.weights is None else g_weights, None,
            None, None, None)


cached_embedding.register_autograd(_backward, setup_context=_setup)

CACHED_EMBEDDING = torch.ops.tidal.cached_embedding.default
"""The op overload the ``embedding_cache`` pass inserts as an fx ``call_function`` target."""
