"""CHAI's clustered attention over a block of query rows, as pure tensor functions: the one
rule the graph's modules (``tidal.passes.chai_modules``), tidal's decoder
(``tidal.runtime.chai.decode``) and the Hugging Face generation cache
(``tidal.runtime.chai.cache``) compute (dissertation ch. 6, §6.2.3).

Per sequence, the first ``first`` real query rows (after any left padding) attend with every
head (:func:`first_rows_attention`); their probabilities give the sequence's membership
(``tidal.ir.head_clusters.sequence_memberships``). Every other row computes scores only for
the sequence's representative heads and each head multiplies its representative's
probabilities with its own V (``tidal::clustered_attention``); :func:`clustered_rows` runs
that op over the block and puts the first rows' every-head result in place. Where every
head's probabilities are at hand anyway, :func:`share_probs` gives each head its
representative's. K and V come per KV head (grouped-query attention: head h reads KV head
``h // (H / Hkv)``); :func:`repeat_kv` spells them out per query head where a step needs it.

Example:
    >>> import torch
    >>> from tidal.ir.clustered_attention_math import (clustered_rows, first_rows,
    ...                                                first_rows_attention, rep_of_heads)
    >>> from tidal.ir.head_clusters import sequence_memberships
    >>> q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    >>> rows = first_rows([0], 5, 9)
    >>> probs, heads = first_rows_attention(q, k, v, 8 ** -0.5, rows, causal=True)
    >>> (m,) = sequence_memberships(probs, 2, (0, 0, 1, 1))
    >>> out = clustered_rows(q, k, v, rep_of_heads([m], 4), 8 ** -0.5, True, None, rows, heads)
    >>> out.shape, torch.equal(out[:, :, :5], heads)
    (torch.Size([1, 4, 9, 8]), True)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tidal.ir.clustered_attention_op import apply_mask  # and registers tidal::clustered_attention
from tidal.ir.head_clusters import Membership


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V ``[..., Hkv, T, D]`` with each KV head repeated for the ``heads`` query heads
    that read it (``x`` itself when it already has ``heads``).

    >>> repeat_kv(torch.arange(2.).view(1, 2, 1, 1), 4).flatten().tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def rep_of_heads(memberships: Sequence[Optional[Membership]], heads: int,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """``[B, H]`` (int64) each head's representative per sequence, the argument
    ``tidal::clustered_attention`` takes; a sequence without a membership (None: still in its
    first tokens) has every head its own.

    >>> rep_of_heads([Membership((0, 0, 1), (1, 2)), None], 3).tolist()
    [[1, 1, 2], [0, 1, 2]]
    """
    own = tuple(range(heads))
    return torch.tensor([own if m is None else m.rep_of_head for m in memberships],
                        device=device)


def share_probs(probs: torch.Tensor, rep_of_head: torch.Tensor) -> torch.Tensor:
    """Every head's rows of ``probs`` ``[B, H, ...]`` replaced by its representative's
    (``rep_of_head`` ``[B, H]``, int64).

    >>> p = torch.tensor([[[0.25], [0.5], [0.75]]])
    >>> share_probs(p, torch.tensor([[1, 1, 2]])).flatten().tolist()
    [0.5, 0.5, 0.75]
    """
    index = rep_of_head.reshape(rep_of_head.shape + (1,) * (probs.dim() - 2))
    return torch.gather(probs, 1, index.expand_as(probs))


def share_rows(probs: torch.Tensor, rep_of_head: torch.Tensor, first: int) -> torch.Tensor:
    """Rows ``first:`` of every head of ``probs`` ``[B, H, Tq, Tk]`` replaced by its
    representative's (:func:`share_probs`); the first rows kept.

    >>> p = torch.arange(4.).view(1, 2, 2, 1)
    >>> share_rows(p, torch.tensor([[0, 0]]), 1).flatten().tolist()
    [0.0, 1.0, 2.0, 1.0]
    """
    return torch.cat((probs[:, :, :first], share_probs(probs[:, :, first:], rep_of_head)),
                     dim=2)


def first_rows(pads: Sequence[int], first: int, tq: int,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """``[B, first]`` the query rows of each sequence's first ``first`` real tokens, after its
    ``pads[b]`` left-padding rows (a sequence with fewer real rows repeats its last one).

    >>> first_rows([0, 3], 2, 4).tolist()
    [[0, 1], [3, 3]]
    """
    start = torch.tensor(list(pads), device=device)[:, None]
    return (start + torch.arange(first, device=device)).clamp(max=tq - 1)


def mask_rows(mask: Optional[torch.Tensor], rows: torch.Tensor, tq: int
              ) -> Optional[torch.Tensor]:
    """The rows ``rows`` ``[B, F]`` of an attention ``mask`` broadcastable to ``[B, H, tq,
    Tk]`` (a mask with one row, or none, applies to every row as it is).

    >>> m = torch.arange(6.).view(3, 2)
    >>> mask_rows(m, torch.tensor([[2, 0]]), 3)[0, 0].tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    if mask is None or mask.dim() < 2 or mask.shape[-2] != tq:
        return mask
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask = mask.expand(rows.shape[0], *mask.shape[1:])
    index = rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
    return torch.gather(mask, 2, index)


def first_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float, rows: torch.Tensor, *, causal: bool,
                         mask: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's attention of the query rows ``rows`` ``[B, F]`` (:func:`first_rows`):
    ``(probs [B, H, F, Tk], out [B, H, F, Dv])``. ``query`` ``[B, H, Tq, D]``, ``key`` /
    ``value`` ``[B, Hkv, Tk, D]``; ``causal``: row i sees keys up to ``Tk - Tq + i`` (aligned
    to the bottom right, as ``tidal::clustered_attention``); ``mask`` broadcastable to ``[B,
    H, Tq, Tk]`` (boolean: True keeps; else added)."""
    b, h, tq, d = query.shape
    tk = key.shape[2]
    q = torch.gather(query, 2, rows[:, None, :, None].expand(b, h, rows.shape[1], d))
    k_all, v_all = repeat_kv(key, h), repeat_kv(value, h)
    scores = q @ k_all.transpose(-1, -2) * scale                          # [B, H, F, Tk]
    if causal:
        seen = torch.arange(tk, device=query.device) <= (rows + (tk - tq))[:, :, None]
        scores = apply_mask(scores, seen[:, None])
    probs = apply_mask(scores, mask_rows(mask, rows, tq)).softmax(dim=-1)
    return probs, probs @ v_all


def clustered_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   rep_of_head: torch.Tensor, scale: float, causal: bool,
                   mask: Optional[torch.Tensor], rows: torch.Tensor,
                   first_out: torch.Tensor) -> torch.Tensor:
    """The clustered attention of the block ``query`` ``[B, H, Tq, D]``: every row through
    ``tidal::clustered_attention`` with ``rep_of_head`` ``[B, H]`` (scores for the
    representatives only), then the rows ``rows`` ``[B, F]`` replaced by ``first_out`` ``[B,
    H, F, Dv]``, their every-head attention (:func:`first_rows_attention`). ``causal`` and
    ``mask`` as the op takes them."""
    out = torch.ops.tidal.clustered_attention(query, key, value, rep_of_head, float(scale),
                                              bool(causal), mask)
    b, h, f = first_out.shape[:3]
    index = rows[:, None, :, None].expand(b, h, f, out.shape[-1])
    return out.scatter_(2, index, first_out)
