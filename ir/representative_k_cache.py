"""CHAI's K cache of representative heads (dissertation ch. 6, §6.2.4): once a layer's
membership is fixed, K is kept only for the KV heads its representatives read, and each decode
step scores only the representatives against those K heads, shares their probabilities with
the members and multiplies each head's with its own V. The one rule tidal's decoder
(``tidal.runtime.chai.decode``) and the Hugging Face generation cache
(``tidal.runtime.chai.cache``) decode by.

``k_cache_layout(memberships, kv_of_head)`` says, per sequence of a batch, which KV head each
kept K slot holds and which representative query heads score against it;
``keep_kv_heads(key, layout.kv_keep)`` cuts K to those slots; ``representatives_step(q, keys,
values, layout, mask, scale)`` is one decode step over them.

Example:
    >>> import torch
    >>> from tidal.ir.head_clusters import Membership
    >>> from tidal.ir.representative_k_cache import (k_cache_layout, keep_kv_heads,
    ...                                              representatives_step)
    >>> m = Membership((0, 0, 0, 0), (0,))              # one cluster of 4 heads on 2 KV heads
    >>> lay = k_cache_layout([m], (0, 0, 1, 1))
    >>> k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> keys = keep_kv_heads(k, lay.kv_keep)              # K of KV head 0 only
    >>> out = representatives_step(torch.randn(1, 4, 1, 8), keys, v, lay, None, 8 ** -0.5)
    >>> tuple(keys.shape), tuple(out.shape)
    ((1, 1, 6, 8), (1, 4, 1, 8))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tidal.ir.clustered_attention_op import apply_mask
from tidal.ir.head_clusters import Membership


@dataclass
class KCacheLayout:
    """Where a layer's pruned K cache keeps what, per sequence of the batch: ``kv_keep``
    ``[B, G']`` the KV head in each K slot; ``q_index`` ``[B, G', R]`` the representative
    query heads that score against each slot (padded by repetition); ``slot_of_head`` ``[B,
    H]`` the score row (``q_index.flatten(1)`` position) each head's probabilities come from;
    ``memberships`` the per-sequence memberships it was made for."""

    kv_keep: torch.Tensor
    q_index: torch.Tensor
    slot_of_head: torch.Tensor
    memberships: tuple[Membership, ...] = ()

    whole: bool = False
    """Every sequence keeps every KV head (in order) and the padded layout would score at
    least as many rows as there are heads: scoring every head and sharing costs no more, and
    K need not be cut."""


def k_cache_layout(memberships: Sequence[Membership], kv_of_head: Sequence[int],
                   device: Optional[torch.device] = None) -> KCacheLayout:
    """The pruned layout for one layer of a batch with these per-sequence memberships:
    ``G'`` the most KV heads any sequence keeps (a sequence keeping fewer repeats its first
    kept head in the spare slots), in each sequence's own order; ``R`` the most
    representatives on one KV head. Under multi-head attention ``G'`` is the cluster count.

    Example:
        >>> m = Membership((0, 0, 1, 1), (1, 2))       # heads 0,1 -> rep 1; heads 2,3 -> rep 2
        >>> lay = k_cache_layout([m], kv_of_head=(0, 0, 1, 1))
        >>> lay.kv_keep.tolist(), lay.q_index.tolist(), lay.slot_of_head.tolist()
        ([[0, 1]], [[[1], [2]]], [[0, 0, 1, 1]])
    """
    keeps, per_kvs = [], []
    for m in memberships:
        keep = sorted({kv_of_head[r] for r in m.representatives})
        keeps.append(keep)
        per_kvs.append([[r for r in m.representatives if kv_of_head[r] == g] for g in keep])
    width = max(len(k) for k in keeps)
    reps = max(len(p) for per_kv in per_kvs for p in per_kv)
    kv_keep, q_index, slots = [], [], []
    for m, keep, per_kv in zip(memberships, keeps, per_kvs):
        rows = [p + [p[0]] * (reps - len(p)) for p in per_kv]
        rows += [rows[0]] * (width - len(rows))
        kv_keep.append(keep + [keep[0]] * (width - len(keep)))
        q_index.append(rows)
        slot = {r: j * reps + i for j, p in enumerate(per_kv) for i, r in enumerate(p)}
        slots.append([slot[r] for r in m.rep_of_head])
    whole = all(k == list(range(len(kv_keep[0]))) for k in kv_keep) and \
        width * reps >= len(kv_of_head) and len(kv_keep[0]) == len(set(kv_of_head))
    return KCacheLayout(torch.tensor(kv_keep, device=device),
                        torch.tensor(q_index, device=device),
                        torch.tensor(slots, device=device), tuple(memberships), whole)


def keep_kv_heads(key: torch.Tensor, kv_keep: torch.Tensor) -> torch.Tensor:
    """``key`` ``[B, Hkv, T, D]`` cut to the kept K slots ``kv_keep`` ``[B, G']``:
    ``[B, G', T, D]``.

    >>> keep_kv_heads(torch.arange(3.).view(1, 3, 1, 1), torch.tensor([[2, 0]])).flatten()
    tensor([2., 0.])
    """
    return torch.gather(key, 1, kv_keep[:, :, None, None].expand(-1, -1, *key.shape[2:]))


def representatives_step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         layout: KCacheLayout, mask: Optional[torch.Tensor],
                         scale: float) -> torch.Tensor:
    """One query token ``q`` ``[B, H, 1, D]`` of a pruned layer: scores for the
    representatives only, against the kept K slots ``keys`` ``[B, G', n, D]`` they read,
    shared with their members, times each head's own V ``values`` ``[B, Hkv, n, D]``
    (``mask``: broadcastable to ``[B, 1, 1, n]``; boolean: True keeps, else added)."""
    b, h, _, d = q.shape
    g_kept, reps = layout.q_index.shape[1:]
    n = keys.shape[2]
    qr = torch.gather(q[:, :, 0], 1, layout.q_index.reshape(b, -1, 1).expand(-1, -1, d))
    scores = qr.view(b, g_kept, reps, d) @ keys.transpose(-1, -2) * scale  # [B, G', R, n]
    probs = apply_mask(scores, mask).softmax(dim=-1).view(b, g_kept * reps, n)
    probs = torch.gather(probs, 1, layout.slot_of_head[:, :, None].expand(-1, -1, n))
    kv = values.shape[1]
    out = probs.view(b, kv, h // kv, n) @ values
    return out.view(b, h, 1, d)
