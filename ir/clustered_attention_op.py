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
import torch.nn.functional as F


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


SHORT_ROWS = 16
"""Blocks of at most this many query rows (decoding) compute each representative's
probabilities once and share them; longer blocks (prefill) run one fused attention call."""


@torch.library.custom_op("tidal::clustered_attention", mutates_args=())
def clustered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        rep_of_head: torch.Tensor, scale: float, is_causal: bool,
                        attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """See the module docstring. Two ways to the same result, by the block's rows: a short
    block (decoding, at most :data:`SHORT_ROWS` rows) computes each representative's
    probabilities once and multiplies them with its members' V heads; a long block runs one
    fused ``scaled_dot_product_attention`` over the (representative, V head) pairs of its
    heads (the fused kernels want one V head per score row: a cluster whose members read
    different V heads computes its representative's scores once per V head, still only with
    the representative's Q and K)."""
    group = _check(query, key, value, rep_of_head)
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    mask = None
    if attn_mask is not None:  # [B or 1, H or 1, Tq, Tk]: a mask shared by heads stays shared
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask = mask.expand(b, mask.shape[1], tq, tk)
    causal = None
    if is_causal and (tq != tk or mask is not None):  # bottom-right, as a mask
        causal = causal_mask(tq, tk, query.device)
    outs = []
    for i, reps_of in enumerate(rep_of_head.tolist()):
        if any(reps_of[r] != r for r in reps_of):
            raise ValueError(f"tidal::clustered_attention: sequence {i}: a representative "
                             f"must represent itself (rep_of_head {reps_of})")
        m = None if mask is None else mask[i]
        if tq <= SHORT_ROWS:
            outs.append(_shared(query[i], key[i], value[i], reps_of, group, scale, causal, m,
                                is_causal and causal is None))
        else:
            outs.append(_pairs(query[i], key[i], value[i], reps_of, group, scale, causal, m,
                               is_causal and causal is None))
    return torch.stack(outs)


def _shared(q, k, v, reps_of, group, scale, causal, mask, square_causal) -> torch.Tensor:
    """One sequence: the representatives' probabilities, each head's from its own."""
    reps = sorted(set(reps_of))
    rows = torch.tensor(reps, device=q.device)
    scores = q[rows] @ k[rows // group].transpose(-1, -2) * scale
    if square_causal:
        causal = causal_mask(*scores.shape[-2:], q.device)
    m = _combined(causal, _heads(mask, rows))
    if m is not None:
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    probs = scores.softmax(dim=-1)
    where = torch.tensor([reps.index(r) for r in reps_of], device=q.device)
    heads = torch.arange(len(reps_of), device=q.device)
    return probs[where] @ v[heads // group]


def _pairs(q, k, v, reps_of, group, scale, causal, mask, square_causal) -> torch.Tensor:
    """One sequence: one fused attention over the (representative, V head) pairs."""
    pairs = sorted({(r, hd // group) for hd, r in enumerate(reps_of)})
    rep = torch.tensor([r for r, _ in pairs], device=q.device)
    kv = torch.tensor([x for _, x in pairs], device=q.device)
    m = _combined(causal, _heads(mask, rep))
    o = F.scaled_dot_product_attention(  # 4-d: CPU's fused kernel wants a batch dim
        q[rep][None], k[rep // group][None], v[kv][None],
        attn_mask=None if m is None else m[None], is_causal=square_causal and q.shape[1] > 1,
        scale=scale)[0]
    where = torch.tensor([pairs.index((r, hd // group)) for hd, r in enumerate(reps_of)],
                         device=q.device)
    return o[where]


def _heads(mask: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """A sequence's mask ``[H or 1, Tq, Tk]`` for the score rows of heads ``rows`` (a mask
    shared by every head is not copied per head)."""
    if mask is None or mask.shape[0] == 1:
        return mask
    return mask[rows]


def _combined(causal: Optional[torch.Tensor], mask: Optional[torch.Tensor]
              ) -> Optional[torch.Tensor]:
    """One mask for ``scaled_dot_product_attention`` from a boolean causal mask and the
    sequence's own (boolean: True keeps; else additive)."""
    if mask is None or causal is None:
        return mask if causal is None else causal
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


def causal_mask(tq: int, tk: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The boolean causal mask ``[tq, tk]`` (True keeps) aligned to the bottom right, as
    ``scaled_dot_product_attention`` aligns it for ``tq < tk``: query row i sees keys up to
    ``tk - tq + i``.

    >>> causal_mask(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def apply_mask(scores: torch.Tensor, mask: Optional[torch.Tensor],
               hides: bool = False) -> torch.Tensor:
    """``scores`` with an attention ``mask`` applied: a boolean mask keeps where True
    (``hides``: hides where True) and puts -inf elsewhere; any other mask is added.

    >>> apply_mask(torch.zeros(1, 2), torch.tensor([[True, False]])).tolist()
    [[0.0, -inf]]
    """
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask if hides else ~mask, float("-inf"))
    return scores + mask


@clustered_attention.register_fake
def _clustered_attention_fake(query, key, value, rep_of_head, scale, is_causal, attn_mask):
    _check(query, key, value, rep_of_head)
    return query.new_empty(query.shape[:3] + value.shape[3:])


def score_heads(rep_of_head: torch.Tensor) -> int:
    """How many heads' scores the op computes for ``rep_of_head`` (summed over the batch):
    the distinct representatives of each sequence."""
    return sum(len(set(row)) for row in rep_of_head.tolist())
