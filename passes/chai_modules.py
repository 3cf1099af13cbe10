"""The modules the ``clustered_attention`` pass installs in a graph (CHAI, dissertation ch. 6):
``ClusteredHeads`` (probabilities shared after a softmax), ``ClusteredSDPA``
(``scaled_dot_product_attention``), ``ClusteredEagerAttention`` (an eager Q·Kᵀ … ·V taken
apart) and ``ClusteredMultiheadAttention`` (``nn.MultiheadAttention``). Their semantics, and
when they compute only the representative heads through ``tidal::clustered_attention``, are
described in ``tidal.passes.clustered_attention``.

Example:
    >>> import torch
    >>> from tidal.passes.chai_modules import ClusteredSDPA
    >>> attn = ClusteredSDPA(layer=0, num_heads=4, num_kv_heads=4, k=4)   # one head per cluster
    >>> q = k = v = torch.randn(1, 4, 8, 16)
    >>> torch.allclose(attn(q, k, v, is_causal=True),
    ...                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    ...                atol=1e-6)
    True
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from tidal.ir.clustered_attention_math import (clustered_rows, first_rows,
                                               first_rows_attention, rep_of_heads, repeat_kv,
                                               share_rows)
from tidal.ir.clustered_attention_op import apply_mask, causal_mask
from tidal.ir.head_clusters import (FIRST_TOKENS, Membership, check_count, kv_head_map,
                                    sequence_memberships)
from tidal.passes.attention_match import EagerParts


class ClusteredHeads(torch.nn.Module):
    """Shares attention probabilities ``[B, H, Tq, Tk]`` (or ``[B*H, Tq, Tk]``, heads merged
    into the batch) between the heads of one layer.

    ``k`` None leaves the layer as it is. ``static`` (a ``Membership``) fixes the clusters
    (CHAI-static); otherwise each batch element is clustered from its first ``first`` tokens.
    ``observer(layer, probs)``, when set, sees the unshared probabilities (calibration).
    ``last_membership`` holds the memberships of the last call (for inspection).

    The subclasses that see Q, K and V (``ClusteredSDPA``, ``ClusteredEagerAttention``,
    ``ClusteredMultiheadAttention``) compute the query rows after the first ``first`` only
    for each sequence's representative heads (``tidal::clustered_attention``); with
    ``representatives_only`` False they compute every head's scores and share the
    probabilities, as this module does after a softmax (the reference semantics, equal up to
    rounding). ``last_route`` says which way the last call went, and why.
    """

    representatives_only: bool = True
    uncaptured_reason = ("clusters heads on the host from the first tokens and checks the "
                         "KV-head layout (host syncs)")
    """Why the lowering runs this module uncaptured (``tidal.runtime.lower.stop_reason``)."""

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, k: Optional[int] = None,
                 first: int = FIRST_TOKENS, static: Optional[Membership] = None) -> None:
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, num_heads, num_kv_heads
        self.first, self.static = first, static
        self.clustering = "linkage"  # tidal.ir.head_clusters.CLUSTERINGS
        self.k = k
        self.observer: Optional[Callable[[int, torch.Tensor], None]] = None
        self.last_membership: tuple[Membership, ...] = ()
        self.last_route = ""

    @property
    def k(self) -> Optional[int]:
        """Cluster count (None: unclustered)."""
        return self._k

    @k.setter
    def k(self, value: Optional[int]) -> None:
        if value is not None:
            check_count(value, self.num_heads, f"attention layer {self.layer}")
        self._k = value

    @property
    def kv_of_head(self) -> tuple[int, ...]:
        """The KV head each query head reads."""
        return kv_head_map(self.num_heads, self.num_kv_heads)

    def memberships(self, probs: torch.Tensor) -> tuple[Membership, ...]:
        """One membership per batch element (static, or from the first tokens), through
        ``tidal.ir.head_clusters.sequence_memberships`` as ``ChaiDecoder`` fixes its own."""
        return sequence_memberships(probs, self.k, self.kv_of_head, self.first,
                                    self.clustering, self.static)

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        if probs.dim() == 3 and probs.shape[0] % self.num_heads == 0:  # [B*H, Tq, Tk]
            split = probs.reshape(-1, self.num_heads, *probs.shape[1:])
            return ClusteredHeads.forward(self, split).reshape(probs.shape)
        if self.observer is not None:
            self.observer(self.layer, probs)
        self.last_route = "all heads: probabilities shared after the softmax"
        if self.k is None or probs.shape[2] <= self.first:
            return probs
        if probs.shape[1] != self.num_heads:
            raise ValueError(f"attention layer {self.layer}: expected {self.num_heads} heads in "
                             f"the probabilities, got shape {tuple(probs.shape)}")
        self.last_membership = self.memberships(probs)
        return share_rows(probs, rep_of_heads(self.last_membership, self.num_heads,
                                              probs.device), self.first)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, heads={self.num_heads}, k={self.k}, first={self.first}"

    def _all_heads_reason(self, rows: int, *tensors: torch.Tensor) -> Optional[str]:
        """Why a call with ``rows`` query rows must compute every head's scores (None: it can
        compute the later rows for the representatives only)."""
        if self.k is None:
            return "unclustered"
        if self.observer is not None:
            return "an observer (calibration) sees every head"
        if not self.representatives_only:
            return "representatives_only is off"
        if rows <= self.first:
            return f"no rows after the first {self.first}"
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return "gradients (tidal::clustered_attention has no backward)"
        return None

    def _kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with one head per KV head: a model that repeated its K/V heads for grouped-
        query attention before the call (Hugging Face's ``repeat_kv``: head h is KV head
        h // group) passes copies; the op reads each KV head once, and a cluster whose members
        share a KV head scores its representative once."""
        group = self.num_heads // self.num_kv_heads
        if group == 1 or x.shape[1] != self.num_heads or \
                not torch.equal(x[:, :group], x[:, :1].expand_as(x[:, :group])):
            return x
        return x[:, ::group]

    def _representatives_only(self, query, key, value, attn_mask, is_causal, scale):
        """Attention of ``query`` ``[B, H, Tq, D]`` on ``key``/``value`` ``[B, H or Hkv, Tk,
        D]`` (``attn_mask`` and ``is_causal`` as ``scaled_dot_product_attention`` takes them):
        the first rows with every head (their probabilities give each sequence's membership),
        the rest through ``tidal::clustered_attention``
        (``tidal.ir.clustered_attention_math``)."""
        key, value = self._kv_heads(key), self._kv_heads(value)
        rows = first_rows([0] * query.shape[0], self.first, query.shape[2], query.device)
        probs, heads_out = first_rows_attention(query, key, value, scale, rows,
                                                causal=bool(is_causal), mask=attn_mask)
        self.last_membership = self.memberships(probs)
        rep = rep_of_heads(self.last_membership, query.shape[1], query.device)
        self.last_route = "representatives"
        return clustered_rows(query, key, value, rep, scale, is_causal, attn_mask, rows,
                              heads_out)


class ClusteredSDPA(ClusteredHeads):
    """``F.scaled_dot_product_attention`` with the probabilities shared. Once a layer has a
    cluster count, the query rows after the first ``first`` compute scores only for their
    sequence's representative heads (``tidal::clustered_attention``, reading K only for the KV
    heads those use); the first rows run every head, and give the membership. Calibration (an
    ``observer``), dropout (``dropout_p`` > 0, in training or not, as in
    ``scaled_dot_product_attention``) and gradients spell every head out.

    The output is laid out in memory as ``scaled_dot_product_attention`` lays out its own:
    ``[B, T, H, D]`` in memory when the query's heads lie inside its time steps (a projection
    ``[B, T, H*D]`` viewed and transposed, as Hugging Face models make it). A graph exported
    from a model that calls ``.transpose(1, 2).contiguous()`` on it keeps no copy where that
    layout made one unnecessary, and views the result.

    Example:
        >>> attn = ClusteredSDPA(layer=0, num_heads=4, num_kv_heads=4, k=2)
        >>> q = torch.randn(1, 9, 4, 8).transpose(1, 2)      # [B, H, T, D] of a [B, T, H, D]
        >>> attn(q, q, q, is_causal=True).transpose(1, 2).is_contiguous()
        True
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):  # type: ignore[override]
        out = self._attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if query.dim() == 4 and query.stride(1) < query.stride(2) \
                and not out.transpose(1, 2).is_contiguous():
            return out.transpose(1, 2).contiguous().transpose(1, 2)
        return out

    def _attention(self, query, key, value, attn_mask, dropout_p, is_causal, scale):
        """The attention (see the class docstring), in whatever memory layout it comes."""
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        why = self._all_heads_reason(query.shape[-2], query, key, value)
        if why is None and query.dim() != 4:
            why = "query not [B, H, T, D]"
        if why is None and dropout_p:    # F.scaled_dot_product_attention: in eval mode too
            why = "dropout"
        if why is None:
            return self._representatives_only(query, key, value, attn_mask, is_causal, scale)
        heads = query.shape[-3]
        key, value = repeat_kv(key, heads), repeat_kv(value, heads)
        scores = query @ key.transpose(-1, -2) * scale
        if is_causal:
            scores = apply_mask(scores, causal_mask(*scores.shape[-2:], scores.device))
        probs = super().forward(apply_mask(scores, attn_mask).softmax(dim=-1))
        self.last_route = f"all heads: {why}"
        if dropout_p:
            probs = F.dropout(probs, dropout_p)
        return probs @ value


# --- eager attention: Q·Kᵀ, scale, mask, softmax, ·V taken out of the graph into one module ---

_WIDE = (torch.float32, torch.float64, torch.bfloat16)
"""Dtypes in which ``x + finfo.min`` is ``finfo.min`` for any score ``x`` (|x| < 1e30): a
boolean mask written as a fill value is an additive mask there."""


class _AllHeads(Exception):
    """An eager call that cannot be written as scale and additive mask (the message says why)."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _AllHeads(f"{what} is a tensor of shape {tuple(value.shape)}, not a number")
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _AllHeads(f"{what} is not a number ({type(value).__name__})")


def _fill_is_mask(value: Any, dtype: torch.dtype) -> float:
    """A fill value (``where``, ``masked_fill``, a lower bound) that hides a score: -inf, or
    ``finfo.min`` (or below) in a dtype where adding it to a score gives it back."""
    v = _number(value, "a fill value")
    if v == float("-inf") or (dtype in _WIDE and v <= torch.finfo(dtype).min):
        return v
    raise _AllHeads(f"fill value {v:g} in {dtype} is not a mask (only -inf, or finfo.min "
                    f"in float32/float64/bfloat16)")


class _Layout:
    """The scores' shape as an eager attention's ops see it (``[B, H, Tq, Tk]``, or
    ``[B*H, Tq, Tk]`` with the heads merged into the batch) and the 4-d view of it."""

    def __init__(self, shape: tuple[int, ...], heads: int) -> None:
        if len(shape) == 3 and shape[0] % heads == 0:
            self.b = shape[0] // heads
        elif len(shape) == 4 and shape[1] == heads:
            self.b = shape[0]
        else:
            raise _AllHeads(f"scores of shape {shape} are not [B, {heads}, Tq, Tk] or "
                            f"[B*{heads}, Tq, Tk]")
        self.shape, self.heads = shape, heads
        self.tq, self.tk = shape[-2:]

    def heads4(self, x: Any) -> Any:
        """Operand ``x`` (broadcast against the scores) in the 4-d layout."""
        if not isinstance(x, torch.Tensor):
            return x
        if torch.broadcast_shapes(tuple(x.shape), self.shape) != self.shape:
            raise _AllHeads(f"an operand of shape {tuple(x.shape)} broadcasts the scores "
                            f"{self.shape}")
        if len(self.shape) == 3 and x.dim() == 3 and x.shape[0] != 1:
            return x.reshape(self.b, self.heads, *x.shape[1:])
        return x

    def view(self, spec: tuple) -> None:
        """Follow a ``view``/``reshape`` of the scores: only merging or splitting B and H."""
        if len(spec) == 1 and isinstance(spec[0], (tuple, list, torch.Size)):
            spec = tuple(spec[0])
        if not all(isinstance(d, int) for d in spec) or list(spec).count(-1) > 1:
            raise _AllHeads(f"a view of the scores to {spec}")
        numel = math.prod(self.shape)
        known = math.prod(d for d in spec if d != -1)
        shape = tuple(numel // known if d == -1 else d for d in spec)
        if shape not in ((self.b * self.heads, self.tq, self.tk),
                         (self.b, self.heads, self.tq, self.tk)):
            raise _AllHeads(f"a view of the scores {self.shape} to {shape}")
        self.shape = shape

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Q, K or V (``[B*H, T, D]`` or ``[B, H, T, D]``) as ``[B, H, T, D]``."""
        return x.reshape(self.b, self.heads, *x.shape[-2:]) if x.dim() == 3 else x


def _scale_and_mask(parts: EagerParts, heads: int, query: torch.Tensor, key_t: torch.Tensor,
                    value: torch.Tensor, operands: tuple, training: bool):
    """``(q, k, v, scale, mask, layout)``: ``[B, H, T, D]`` Q, K, V and the scale and additive
    mask (None or broadcastable to ``[B, H, Tq, Tk]``) with which ``softmax(scale * Q Kᵀ +
    mask) @ V`` is what ``parts`` compute, up to rounding; ``_AllHeads`` when it is not."""
    if not query.dim() == key_t.dim() == value.dim() or query.dim() not in (3, 4) or \
            query.shape[:-2] != key_t.shape[:-2] or query.shape[:-2] != value.shape[:-2]:
        raise _AllHeads(f"Q, Kᵀ, V of shapes {tuple(query.shape)}, {tuple(key_t.shape)}, "
                        f"{tuple(value.shape)}")
    dtype = query.dtype
    if key_t.dtype != dtype or value.dtype != dtype:
        raise _AllHeads(f"Q, K, V in {dtype}, {key_t.dtype}, {value.dtype}")
    layout = _Layout(tuple(query.shape[:-1]) + (key_t.shape[-1],), heads)
    probe = query.new_empty((1,))
    scale, mask = 1.0, None

    def combined(other: Any) -> torch.Tensor:
        """``mask`` plus the score dtype's zero, checked to keep the scores' dtype."""
        if isinstance(other, torch.Tensor) and torch.result_type(probe, other) != dtype:
            raise _AllHeads(f"an operand in {other.dtype} promotes the {dtype} scores")
        return probe.new_zeros(()) if mask is None else mask

    for step in parts.steps:
        p = step.values(operands, training)
        if step.kind in ("scale", "divide"):
            f = _number(p[0], f"the {step.kind} factor")
            if f == 0 or not math.isfinite(f):
                raise _AllHeads(f"the {step.kind} factor {f}")
            scale = scale * f if step.kind == "scale" else scale / f
            mask = None if mask is None else mask * f if step.kind == "scale" else mask / f
        elif step.kind in ("add", "subtract"):
            m = combined(p[0])
            other = layout.heads4(p[0])
            mask = m + other if step.kind == "add" else m - other
        elif step.kind in ("where", "masked_fill"):
            cond, fill = layout.heads4(p[0]), _fill_is_mask(p[1], dtype)
            if not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool:
                raise _AllHeads(f"a {step.kind} whose condition is not a boolean tensor")
            keep = step.kind == "where" and p[2]
            m = combined(fill)
            mask = torch.where(cond, m, fill) if keep else torch.where(cond, fill, m)
        elif step.kind == "clamp_min":
            bound = _fill_is_mask(p[0], dtype)
            mask = None if mask is None else mask.clamp_min(bound)
        elif step.kind == "view":
            layout.view(p)
        elif step.kind == "cast":
            out = step.replay(probe, operands, training)
            if out.dtype != dtype or out.device != probe.device:
                raise _AllHeads(f"a cast of the {dtype} scores to {out.dtype}")
        elif step.kind != "same":
            raise _AllHeads(f"a {step.kind} step before the softmax")
    dim, softmax_dtype = parts.softmax.values(operands, training)
    if not isinstance(dim, int) or dim % len(layout.shape) != len(layout.shape) - 1:
        raise _AllHeads(f"softmax over dim {dim} of {len(layout.shape)}")
    if softmax_dtype not in (None, dtype):
        raise _AllHeads(f"softmax in {softmax_dtype} of {dtype} scores")
    for step in parts.post:
        if step.kind == "dropout":
            p, on = step.values(operands, training)
            if on and _number(p, "the dropout probability") > 0:
                raise _AllHeads("dropout in training")
        elif step.kind == "cast" and step.replay(probe, operands, training).dtype != dtype:
            raise _AllHeads("a cast of the probabilities")
    if value.dim() != len(layout.shape):
        raise _AllHeads(f"V {tuple(value.shape)} for probabilities {layout.shape}")
    if mask is not None and torch.broadcast_shapes(tuple(mask.shape), (
            layout.b, heads, layout.tq, layout.tk)) != (layout.b, heads, layout.tq, layout.tk):
        raise _AllHeads(f"a mask of shape {tuple(mask.shape)}")
    k = layout.split(key_t.transpose(-1, -2))
    return layout.split(query), k, layout.split(value), scale, mask, layout


class ClusteredEagerAttention(ClusteredHeads):
    """An eager attention ``softmax(mask(scale(Q @ Kᵀ))) @ V`` taken out of the graph whole
    (``parts``: the ops between, from ``attention_match.eager_parts``), called as
    ``(query, key_t, value, *operands)`` with the values the ops read, and returning what
    ``· @ V`` returned (``[B, H, Tq, Dv]``, or ``[B*H, Tq, Dv]`` for heads merged into the
    batch).

    When the ops between are a scale (a number, a 0-d tensor; before the matmul, folded into
    Q, as well) and an additive mask (added tensors, and boolean masks written as ``where``/
    ``masked_fill``/``clamp_min`` with -inf, or with ``finfo.min`` in float32/float64/
    bfloat16), views that merge or split batch and heads, casts that change nothing, and
    dropout that is off, the layer runs as ``ClusteredSDPA`` does: the first rows with every
    head, the rest only for each sequence's representative heads (``tidal::clustered_attention``).
    Otherwise (and for calibration, gradients, ``representatives_only`` off) it replays the
    original ops on every head and shares the probabilities after the softmax; ``last_route``
    says why.
    """

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, parts: EagerParts,
                 k: Optional[int] = None, first: int = FIRST_TOKENS,
                 static: Optional[Membership] = None) -> None:
        super().__init__(layer, num_heads, num_kv_heads, k, first, static)
        self.parts = parts

    def forward(self, query, key_t, value, *operands):  # type: ignore[override]
        why = self._all_heads_reason(query.shape[-2], query, key_t, value)
        if why is None:
            try:
                q, k, v, scale, mask, layout = _scale_and_mask(
                    self.parts, self.num_heads, query, key_t, value, operands, self.training)
            except _AllHeads as e:
                why = str(e)
            else:
                out = self._representatives_only(q, k, v, mask, False, scale)
                return out.reshape(layout.shape[:-1] + out.shape[-1:])
        chain = [torch.matmul(query, key_t)]
        for step in self.parts.steps + (self.parts.softmax,):
            chain.append(step.replay(chain[-1], operands, self.training))
        chain[-1] = ClusteredHeads.forward(self, chain[-1])
        self.last_route = f"all heads: {why}"
        for step in self.parts.post:
            chain.append(step.replay(chain[-1], operands, self.training, chain))
        return torch.matmul(chain[-1], value)


def _mha_attribute(name: str) -> property:
    """A read-only attribute of ``ClusteredMultiheadAttention`` that is its ``mha``'s."""
    return property(lambda self: getattr(self.mha, name),
                    doc=f"The wrapped ``nn.MultiheadAttention``'s ``{name}``.")


def _mha_masks(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
               heads: int) -> list[torch.Tensor]:
    """``nn.MultiheadAttention``'s masks (boolean: True hides; else added), each broadcastable
    to ``[B, H, Tq, Tk]``."""
    if attn_mask is not None and attn_mask.dim() == 3:      # [B*H, Tq, Tk]
        attn_mask = attn_mask.reshape(-1, heads, *attn_mask.shape[-2:])
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask[:, None, None, :]
    return [m for m in (attn_mask, key_padding_mask) if m is not None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask of ``_mha_masks`` as one to add (-inf where a boolean mask hides)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask,
                                                                              float("-inf"))


class ClusteredMultiheadAttention(ClusteredHeads):
    """``nn.MultiheadAttention`` (packed in-projection, no bias_k/zero-attn) with the
    probabilities shared; same call signature and outputs. Once the layer has a cluster count,
    the query rows after the first ``first`` compute scores only for their sequence's
    representative heads (``tidal::clustered_attention``; the masks are passed through); the
    attention weights (``need_weights``), dropout in training, calibration and gradients
    compute every head's."""

    def __init__(self, mha: torch.nn.MultiheadAttention, layer: int, **kw: Any) -> None:
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"attention layer {layer}: nn.MultiheadAttention with separate "
                             f"kdim/vdim, bias_k/bias_v or add_zero_attn is not supported")
        super().__init__(layer, mha.num_heads, mha.num_heads, **kw)
        self.mha = mha
        self.train(mha.training)

    # What torch's transformer layers read off their ``self_attn`` before they choose the
    # general path (``slow_path_copy``); anything their fused path reads further is missing,
    # so it fails loudly rather than skipping the clustering.
    batch_first = _mha_attribute("batch_first")
    in_proj_bias = _mha_attribute("in_proj_bias")
    _qkv_same_embed_dim = _mha_attribute("_qkv_same_embed_dim")

    def forward(self, query, key, value, key_padding_mask=None,  # type: ignore[override]
                need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
        m = self.mha
        if m.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        tq, b, e = query.shape
        w, bias = m.in_proj_weight, m.in_proj_bias
        bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
        wq, wk, wv = w.chunk(3)
        heads, d = m.num_heads, m.head_dim

        def split(x, wt, bs):
            return F.linear(x, wt, bs).reshape(x.shape[0], b, heads, d).permute(1, 2, 0, 3)

        q, k, v = split(query, wq, bq), split(key, wk, bk), split(value, wv, bv)
        why = self._all_heads_reason(tq, q, k, v)
        if why is None and need_weights:
            why = "the attention weights are returned (need_weights)"
        if why is None and m.dropout and self.training:
            why = "dropout in training"
        if why is None:
            masks = [_additive(x, q.dtype) for x in _mha_masks(attn_mask, key_padding_mask,
                                                                 heads)]
            mask = sum(masks[1:], masks[0]) if masks else None
            probs, out = None, self._representatives_only(q, k, v, mask, False,
                                                          1 / math.sqrt(d))
        else:
            probs, out = self._all_heads(q, k, v, attn_mask, key_padding_mask)
            self.last_route = f"all heads: {why}"
        out = m.out_proj(out.permute(2, 0, 1, 3).reshape(tq, b, e))
        if m.batch_first:
            out = out.transpose(0, 1)
        weights = None
        if need_weights:
            weights = probs.mean(dim=1) if average_attn_weights else probs
        return out, weights

    def _all_heads(self, q, k, v, attn_mask, key_padding_mask):
        """Every head's probabilities, shared, and the attention output ``[B, H, Tq, D]``."""
        heads = q.shape[1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        for mask in _mha_masks(attn_mask, key_padding_mask, heads):
            scores = apply_mask(scores, mask, hides=True)
        probs = ClusteredHeads.forward(self, scores.softmax(dim=-1))
        if self.mha.dropout and self.training:
            probs = F.dropout(probs, self.mha.dropout)
        return probs, probs @ v
