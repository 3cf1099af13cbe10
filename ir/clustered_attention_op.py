"""``tidal::clustered_attention``: CHAI's attention that scores only representative heads.

CHAI (dissertation ch. 6) clusters the query heads of a layer; every head of a cluster uses its
representative's attention probabilities, and V stays per head. This op computes exactly that
for a block of query rows, doing only the work the clustering leaves: for each sequence it
computes ``softmax(scale * Q_r K_{kv(r)}^T + mask)`` for the *distinct* representatives ``r``
of its heads (reading K only for the KV heads those representatives use) and multiplies each
head's representative's probabilities with the head's own V. With one head per cluster
(``rep_of_head[b] == arange(H)``) it is scaled-dot-product attention.

Arguments: ``query`` ``[B, H, Tq, D]``, ``key`` ``[B, Hkv, Tk, D]``, ``value`` ``[B, Hkv, Tk,
Dv]`` (grouped-query attention: ``H`` a multiple of ``Hkv``, head h reads KV head ``h // (H /
Hkv)``), ``rep_of_head`` ``[B, H]`` (int64: each head's representative, itself a head of the
same sequence whose representative is itself), ``scale``, ``is_causal`` (the causal mask aligned
to the bottom right, as ``scaled_dot_product_attention`` aligns it for ``Tq < Tk``: query row i
sees keys up to ``Tk - Tq + i``, so a block of the *last* rows keeps its causality) and an
optional ``attn_mask`` broadcastable to ``[B, H, Tq, Tk]`` (boolean: True keeps; else added).
It has a fake kernel (shapes only), so it traces, captures with ``make_fx`` and exports.

Example:
    >>> import torch
    >>> from tidal.ir import clustered_attention_op  # registers the op
    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> rep = torch.tensor([[0, 0, 2, 2]])          # heads 1 and 3 share 0's and 2's scores
    >>> out = torch.ops.tidal.clustered_attention(q, k, v, rep, 8 ** -0.5, False, None)
    >>> tuple(out.shape), clustered_attention_op.score_heads(rep)
    ((1, 4, 3, 8), 2)
"""
from __future__ import annotations

from typing import Optional

import torch


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           rep_of_head: torch.Tensor) -> int:
    """The query heads per KV head; ``ValueError`` naming the argument whose shape is wrong."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"tidal::clustered_attention: query, key and value must be [B, heads, "
                         f"T, D]; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    b, h = query.shape[:2]
    if key.shape[1] != value.shape[1] or h % key.shape[1]:
        raise ValueError(f"tidal::clustered_attention: {h} query heads cannot share "
                         f"{key.shape[1]} key / {value.shape[1]} value heads")
    if tuple(rep_of_head.shape) != (b, h):
        raise ValueError(f"tidal::clustered_attention: rep_of_head must be [B, H] = [{b}, {h}], "
                         f"got {tuple(rep_of_head.shape)}")
    return h // key.shape[1]


def _masked(scores: torch.Tensor, is_causal: bool, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if is_causal:
        tq, tk = scores.shape[-2:]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=scores.device).tril(tk - tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    return scores


@torch.library.custom_op("tidal::clustered_attention", mutates_args=())
def clustered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        rep_of_head: torch.Tensor, scale: float, is_causal: bool,
                        attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """See the module docstring."""
    group = _check(query, key, value, rep_of_head)
    b, h, tq, _ = query.shape
    mask = None if attn_mask is None else attn_mask.expand(b, h, tq, key.shape[2])
    heads = torch.arange(h, device=query.device)
    outs = []
    for i, reps_of in enumerate(rep_of_head.tolist()):
        reps = sorted(set(reps_of))
        if any(reps_of[r] != r for r in reps):
            raise ValueError(f"tidal::clustered_attention: sequence {i}: a representative "
                             f"must represent itself (rep_of_head {reps_of})")
        where = torch.tensor([reps.index(r) for r in reps_of], device=query.device)
        rep_index = torch.tensor(reps, device=query.device)
        scores = query[i, rep_index] @ key[i, rep_index // group].transpose(-1, -2) * scale
        probs = _masked(scores, is_causal, None if mask is None else mask[i, rep_index])
        probs = probs.softmax(dim=-1)
        outs.append(probs[where] @ value[i, heads // group])
    return torch.stack(outs)


@clustered_attention.register_fake
def _clustered_attention_fake(query, key, value, rep_of_head, scale, is_causal, attn_mask):
    _check(query, key, value, rep_of_head)
    return query.new_empty(query.shape[:3] + value.shape[3:])


def score_heads(rep_of_head: torch.Tensor) -> int:
    """How many heads' scores the op computes for ``rep_of_head`` (summed over the batch):
    the distinct representatives of each sequence."""
    return sum(len(set(row)) for row in rep_of_head.tolist())
