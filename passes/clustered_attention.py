"""Pass ``clustered_attention``: CHAI, clustered head attention (dissertation ch. 6).

Every attention layer the matcher finds (``attention_match``) gets a ``ClusteredHeads`` module
with that layer's cluster count k:

- eager attention (``softmax(mask(scale(Q @ Kᵀ))) @ V``, also with the heads merged into the
  batch as OPT's ``bmm`` on ``[B*H, T, D]`` does): the nodes from ``Q @ Kᵀ`` to ``· @ V`` become
  one ``ClusteredEagerAttention`` call on Q, Kᵀ, V and the values the ops between read
  (``attention_match.eager_parts``). Where those ops cannot be taken apart (an op between
  that is not a scale, a mask, a view of batch and heads, a cast or dropout, e.g. a head mask
  or soft-capping, or a node outside reading the scores or probabilities), a ``ClusteredHeads``
  is inserted after the softmax instead, and the pass notes the layer and why;
- ``scaled_dot_product_attention``: the call becomes a ``ClusteredSDPA`` module;
- ``nn.MultiheadAttention``: the module is replaced by ``ClusteredMultiheadAttention``. Inside
  torch's ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` (and stacks of them,
  which fx keeps whole as one ``call_module``), the graph gets its own copy of the layer or
  stack (``slow_path_copy``: new module objects sharing the model's parameters, so the model is
  left as it was) with each layer's ``self_attn`` replaced, and with torch's fused fast paths
  (``torch._transformer_encoder_layer_fwd``, nested tensors) turned off in the copy, so that
  every layer runs its ``_sa_block`` and calls its ``self_attn``. A decoder layer's
  cross-attention is left as it is, and the pass notes it.

Reference semantics (what the rewritten graph computes, and what ``runtime.chai_decode``
computes faster): the first ``first_tokens`` (5) query tokens use every head's own attention;
from them the heads are clustered into k clusters (online membership, ``tidal.ir.head_clusters.
membership``; or the fixed offline membership in "static" mode, CHAI-static); every later query
token of a head uses the attention probabilities of its cluster's representative head. V stays
per head. Sharing probabilities is sharing scores (softmax of the representative's Q·Kᵀ), so
with k = H (one head per cluster) the output equals multi-head attention exactly.

``ClusteredSDPA``, ``ClusteredEagerAttention`` and ``ClusteredMultiheadAttention`` skip the
work: after the first tokens they compute scores only for each sequence's representative heads
(``tidal::clustered_attention``, reading K only for the KV heads those use). An eager layer
does so when its scale is a number and its masks add up to an additive mask (a boolean mask
written with -inf, or with ``finfo.min`` in float32/float64/bfloat16, where adding it to a
score gives ``finfo.min`` back), ``nn.MultiheadAttention`` when its attention weights are not
needed (the pass sets ``need_weights=False`` where the graph never reads them). Every head's
scores are computed, and the probabilities shared after the softmax, for calibration (an
``observer``), dropout in training, gradients (the op has no backward), masks or scales the op
cannot take, and with ``representatives_only`` off (the reference, for checks); each module's
``last_route`` says which way its last call went. Layers left with a ``ClusteredHeads`` after
the softmax always compute every head. The smaller K cache is realised by
``tidal.runtime.chai_cache`` (Hugging Face ``generate`` through ``compiled.generate``) and
``tidal.runtime.chai_decode`` (tidal's own decoder).

``calibrate(model, batches)`` runs the offline phase (elbow + accuracy budget) and returns a
``ChaiPlan`` to give back as ``plan=``.

Example:
    >>> import torch, tidal
    >>> from examples.models import llama_small
    >>> from tidal.passes.clustered_attention import ClusteredAttention, chai_modules
    >>> model = llama_small().eval()
    >>> ids = model.example_inputs(2)
    >>> same = tidal.compile(model, ids, passes=[ClusteredAttention(clusters=4)])  # k = H
    >>> torch.testing.assert_close(same(*ids), model(*ids))
    >>> fewer = tidal.compile(model, ids, passes=[ClusteredAttention(clusters=2)])
    >>> fewer.plan.get("clustered_attention").summary()
    '2/2 layers clustered (k per layer: 2,2; online)'
    >>> [m.last_route for m in chai_modules(fewer.graph_module)]  # the eager layers, taken apart
    ['representatives', 'representatives']
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from tidal.ir import clustered_attention_op  # noqa: F401  (registers tidal::clustered_attention)
from tidal.ir import meta
from tidal.ir.capture import trace
from tidal.ir.inputs import bind_inputs
from tidal.ir.module_copy import structural_copy
from tidal.ir.head_clusters import (CLUSTERINGS, FIRST_TOKENS, Membership, check_count,
                                    online_memberships, static_membership)
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.ir.plot import Axis, Series, line_chart, palette
from tidal.passes.attention_match import (AttentionMatch, EagerParts, NotMappable,
                                          eager_parts, find_attention, hidden_attention,
                                          no_attention_message)
from tidal.passes.chai_calibrate import (Budget, HeadStats, choose_counts, elbow,
                                         mildest_useful_k, split_holdout, verdict)

PASS_NAME = "clustered_attention"

NOT_CALIBRATED = ("not calibrated: call calibrate() or pass clusters= (or plan=); "
                  "the model is left unchanged")
"""The pass's only note when it has neither cluster counts nor a plan."""


def share_rows(probs: torch.Tensor, rep_of_head: torch.Tensor, first: int) -> torch.Tensor:
    """Rows ``first:`` of every head replaced by its representative's: ``probs`` ``[B, H, Tq,
    Tk]``, ``rep_of_head`` ``[B, H]`` (long)."""
    tail = probs[:, :, first:]
    index = rep_of_head[:, :, None, None].expand_as(tail)
    return torch.cat((probs[:, :, :first], torch.gather(tail, 1, index)), dim=2)


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
        group = self.num_heads // self.num_kv_heads
        return tuple(h // group for h in range(self.num_heads))

    def memberships(self, probs: torch.Tensor) -> tuple[Membership, ...]:
        """One membership per batch element (static, or from the first tokens through
        ``tidal.ir.head_clusters.online_memberships``, as ``ChaiDecoder`` does)."""
        if self.static is not None:
            return (self.static,) * probs.shape[0]
        return online_memberships(probs, self.k, self.kv_of_head, self.first, self.clustering)

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
        rep = torch.tensor([m.rep_of_head for m in self.last_membership], device=probs.device)
        return share_rows(probs, rep, self.first)

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
        the rest through ``tidal::clustered_attention``."""
        first, (tq, tk) = self.first, (query.shape[2], key.shape[2])
        heads = query.shape[1]
        key, value = self._kv_heads(key), self._kv_heads(value)
        mask_first = attn_mask
        if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == tq:
            mask_first = attn_mask[..., :first, :]
        causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)[:first] \
            if is_causal else None  # the first rows keep their place in the whole block
        k_all, v_all = _repeat_kv(key, heads), _repeat_kv(value, heads)
        scores = query[:, :, :first] @ k_all.transpose(-1, -2) * scale
        probs = _masked(_masked(scores, causal), mask_first).softmax(dim=-1)
        self.last_membership = self.memberships(probs)
        rep = torch.tensor([m.rep_of_head for m in self.last_membership], device=query.device)
        # the op takes every row (a square causal block runs SDPA's fused causal kernel); its
        # first rows, computed with the representatives' scores, are replaced
        rest = torch.ops.tidal.clustered_attention(query, key, value, rep, float(scale),
                                                   bool(is_causal), attn_mask)
        self.last_route = "representatives"
        return torch.cat((probs @ v_all, rest[:, :, first:]), dim=2)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _masked(scores: torch.Tensor, mask: Optional[torch.Tensor],
            hides: bool = False) -> torch.Tensor:
    """``scores`` with ``mask`` applied: a boolean mask keeps where True (``hides``: hides
    where True) and puts -inf elsewhere; any other mask is added."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask if hides else ~mask, float("-inf"))
    return scores + mask


class ClusteredSDPA(ClusteredHeads):
    """``F.scaled_dot_product_attention`` with the probabilities shared. Once a layer has a
    cluster count, the query rows after the first ``first`` compute scores only for their
    sequence's representative heads (``tidal::clustered_attention``, reading K only for the KV
    heads those use); the first rows run every head, and give the membership. Calibration (an
    ``observer``), dropout (``dropout_p`` > 0, in training or not, as in
    ``scaled_dot_product_attention``) and gradients spell every head out."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):  # type: ignore[override]
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        why = self._all_heads_reason(query.shape[-2], query, key, value)
        if why is None and query.dim() != 4:
            why = "query not [B, H, T, D]"
        if why is None and dropout_p:    # F.scaled_dot_product_attention: in eval mode too
            why = "dropout"
        if why is None:
            return self._representatives_only(query, key, value, attn_mask, is_causal, scale)
        heads = query.shape[-3]
        key, value = _repeat_kv(key, heads), _repeat_kv(value, heads)
        scores = query @ key.transpose(-1, -2) * scale
        if is_causal:
            tq, tk = scores.shape[-2:]
            scores = _masked(scores, torch.ones(tq, tk, dtype=torch.bool,
                                                device=scores.device).tril(tk - tq))
        probs = super().forward(_masked(scores, attn_mask).softmax(dim=-1))
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
            scores = _masked(scores, mask, hides=True)
        probs = ClusteredHeads.forward(self, scores.softmax(dim=-1))
        if self.mha.dropout and self.training:
            probs = F.dropout(probs, self.mha.dropout)
        return probs, probs @ v


@dataclass(frozen=True)
class ChaiNodeMeta:
    """What the pass records on a rewritten node, one per attention layer the node runs (a
    tuple: a torch transformer stack kept whole runs several): the layer and its cluster
    count."""

    layer: int
    num_heads: int
    num_kv_heads: int
    k: Optional[int]


def _unique_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def slow_path_copy(mod: torch.nn.Module) -> torch.nn.Module:
    """``structural_copy`` of a torch transformer layer or stack with torch's fused inference
    paths off in the copy: no nested-tensor conversion in ``nn.TransformerEncoder``
    (``use_nested_tensor``) and no ``torch._transformer_encoder_layer_fwd`` in
    ``nn.TransformerEncoderLayer`` (``activation_relu_or_gelu`` 0 marks the activation as
    general; the layer's ``_ff_block`` still calls its own ``activation``). Each layer then runs
    its ``_sa_block``, which calls ``self_attn``. Padded positions (``src_key_padding_mask``)
    hold what torch's general path computes there, as in training; torch's nested-tensor
    inference path would return zeros there instead."""
    new = structural_copy(mod)
    for sub in new.modules():
        if isinstance(sub, torch.nn.TransformerEncoder):
            sub.use_nested_tensor = False
        if isinstance(sub, torch.nn.TransformerEncoderLayer):
            sub.activation_relu_or_gelu = 0
    return new


def _own_containers(gm: fx.GraphModule, matches: list[AttentionMatch]) -> None:
    """Give ``gm`` its own ``slow_path_copy`` of every module it calls whole that holds a
    matched ``nn.MultiheadAttention`` below it (a torch transformer layer or stack)."""
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_module"}
    containers = {targets[m.node] for m in matches
                  if m.kind == "module" and m.scope != targets[m.node]}
    for target in containers:
        gm.add_submodule(target, slow_path_copy(gm.get_submodule(target)))


def _weights_unused(node: fx.Node) -> bool:
    """Whether the graph reads only the output of ``nn.MultiheadAttention`` call ``node``, not
    its attention weights (element 1 of the tuple)."""
    return all(u.op == "call_function" and u.target is operator.getitem and
               (u.args[1] == 0 or not u.users) for u in node.users)


def _without_weights(match: AttentionMatch, node: fx.Node) -> Optional[str]:
    """For a ``nn.MultiheadAttention`` the graph calls itself: ``need_weights=False`` when
    the weights are never read (so that the layer may compute only representatives' scores);
    else why not."""
    if node.target != match.scope:
        return None    # inside torch's transformer layers, which ask for no weights
    if not _weights_unused(node):
        return "its attention weights are read (need_weights)"
    if len(node.args) > 4:   # need_weights given by position
        node.args = node.args[:4] + (False,) + node.args[5:]
    else:
        node.kwargs = {**node.kwargs, "need_weights": False}
    return None


def _replace_eager(gm: fx.GraphModule, target: str, parts: EagerParts) -> fx.Node:
    """Replace the nodes of an eager attention (``parts``) by a call of ``target``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    query, output = nodes[parts.query], nodes[parts.output]
    for name in parts.redirect:     # getattr(chain node, "dtype"/"device"): the query's
        r = nodes[name]
        r.args = (query,) + r.args[1:]
    args = tuple(nodes[x] for x in (parts.query, parts.key_t, parts.value) + parts.operands)
    with gm.graph.inserting_before(output):
        new = gm.graph.call_module(target, args)
    new.meta.update(output.meta)
    output.replace_all_uses_with(new)
    for name in reversed(parts.removed):
        gm.graph.erase_node(nodes[name])
    return new


def _rewrite(gm: fx.GraphModule, match: AttentionMatch,
             module: ClusteredHeads) -> tuple[fx.Node, Optional[str]]:
    """Install ``module``'s settings for ``match`` in ``gm``; returns the node that calls the
    layer and, where the layer must compute every head's scores, why (None: after the first
    rows it computes only representatives' scores). A match inside a module ``gm`` calls whole
    needs ``_own_containers`` first."""
    node = next(n for n in gm.graph.nodes if n.name == match.node)
    if match.kind == "module":
        orig = gm.get_submodule(match.scope)
        wrapped = ClusteredMultiheadAttention(orig, match.index, k=module.k, first=module.first,
                                              static=module.static)
        wrapped.clustering = module.clustering
        gm.add_submodule(match.scope, wrapped)
        return node, _without_weights(match, node)
    target = _unique_name(gm, f"chai_attention_{match.index}")
    if match.kind == "sdpa":
        gm.add_submodule(target, module)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(target, node.args, node.kwargs)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return new, None
    try:
        parts = eager_parts(gm, match)
    except NotMappable as e:
        why = str(e)
    else:
        eager = ClusteredEagerAttention(module.layer, module.num_heads, module.num_kv_heads,
                                        parts, module.k, module.first, module.static)
        eager.clustering = module.clustering
        eager.train(gm.training)    # as the graph's nn.Dropout modules its steps stand for
        gm.add_submodule(target, eager)
        return _replace_eager(gm, target, parts), None
    gm.add_submodule(target, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(target, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    return new, why


def chai_modules(gm: torch.nn.Module) -> list[ClusteredHeads]:
    """The ``ClusteredHeads`` modules of a rewritten model, by layer."""
    return sorted((m for m in gm.modules() if isinstance(m, ClusteredHeads)),
                  key=lambda m: m.layer)


def set_counts(gm: torch.nn.Module, counts: dict[int, Optional[int]]) -> None:
    """Set each layer's cluster count (missing layers: unclustered)."""
    for m in chai_modules(gm):
        m.k = counts.get(m.layer)


def _membership_text(gm: fx.GraphModule) -> str:
    lines = ["layer  k  membership of a sample sequence (cluster per head; *representative)"]
    for m in chai_modules(gm):
        if not m.last_membership:
            lines.append(f"{m.layer:>5}  -  unclustered")
            continue
        mem = m.last_membership[0]
        heads = " ".join(f"{c}{'*' if mem.representatives[c] == h else ''}"
                         for h, c in enumerate(mem.labels))
        lines.append(f"{m.layer:>5} {m.k:>2}  {heads}")
    return "\n".join(lines)


def elbow_svg(plan: ChaiPlan) -> str:
    """A small SVG chart of every layer's normalised clustering-error curve against k, its
    elbow (circle) and chosen k (square)."""
    layers = [c for c in plan.layers if c.errors and c.errors[0] > 0]
    colors = palette(len(layers))
    series = []
    for c, hue in zip(layers, colors):
        pts = tuple((k, v / c.errors[0]) for k, v in enumerate(c.errors, 1))
        series.append(Series(f"layer {c.layer}", pts, hue, circles=(pts[c.elbow_k - 1],),
                             squares=() if c.chosen_k is None else (pts[c.chosen_k - 1],)))
    n = max((len(c.errors) for c in layers), default=1)
    top = max((v for s in series for _, v in s.points), default=1.0)
    return line_chart(series, Axis(1, n, "clusters k"),
                      Axis(0, max(top, 1.0), "error / error at k=1"),
                      title="clustering error vs k (normalised), o elbow, [] chosen",
                      width=480, height=300)


class ClusteredAttention(Pass):
    """CHAI: heads clustered per layer, scores shared within a cluster after the first tokens.

    Options: ``clusters`` (one k for every layer, or one k or None per layer), or ``plan`` (a
    ``ChaiPlan`` from :func:`calibrate`); ``mode`` "online" (membership from each sequence's
    first ``first_tokens`` tokens) or "static" (the plan's offline membership); ``clustering``
    "linkage" (default) or "kmeans" (a plan's own wins). With neither
    ``clusters`` nor ``plan`` (e.g. under ``passes="auto"``) the pass is not calibrated: it
    leaves the graph unchanged, returns no plan and says so (``NOT_CALIBRATED``). A layer
    given None in ``clusters`` is installed unclustered (what ``calibrate`` observes through).
    """

    name = PASS_NAME

    def __init__(self, clusters: Union[int, Sequence[Optional[int]], None] = None,
                 plan: Optional[ChaiPlan] = None, mode: str = "online",
                 first_tokens: int = FIRST_TOKENS, clustering: str = "linkage") -> None:
        if clustering not in CLUSTERINGS:
            raise ValueError(f"clustered_attention: clustering must be one of {CLUSTERINGS}, "
                             f"got {clustering!r}")
        self.clustering = clustering
        if mode not in ("online", "static"):
            raise ValueError(f"clustered_attention: mode must be 'online' or 'static', "
                             f"got {mode!r}")
        if mode == "static" and plan is None:
            raise ValueError("clustered_attention: mode='static' needs a plan with the offline "
                             "membership (from calibrate())")
        if first_tokens < 1:
            raise ValueError(f"clustered_attention: first_tokens must be >= 1, got {first_tokens}")
        self.clusters, self.plan, self.mode, self.first = clusters, plan, mode, first_tokens

    def _choices(self, matches: list[AttentionMatch]) -> list[LayerChoice]:
        if self.plan is not None:
            if len(self.plan.layers) != len(matches):
                self.fail(f"the plan has {len(self.plan.layers)} layers but the graph has "
                          f"{len(matches)} attention layers")
            return list(self.plan.layers)
        ks: list[Optional[int]]
        if self.clusters is None or isinstance(self.clusters, int):
            ks = [self.clusters] * len(matches)
        else:
            ks = list(self.clusters)
            if len(ks) != len(matches):
                raise ValueError(f"clustered_attention: clusters has {len(ks)} entries but the "
                                 f"graph has {len(matches)} attention layers")
        return [LayerChoice(m.index, m.scope, m.num_heads, m.num_kv_heads, m.head_dim, k, 0)
                for m, k in zip(matches, ks)]

    def _module(self, match: AttentionMatch, choice: LayerChoice) -> ClusteredHeads:
        """The clustering module for one attention layer."""
        static = None
        if self.mode == "static" and choice.chosen_k is not None:
            static = Membership(choice.static_labels, choice.static_reps)
        mod_cls = ClusteredSDPA if match.kind == "sdpa" else ClusteredHeads
        module = mod_cls(match.index, match.num_heads, match.num_kv_heads, choice.chosen_k,
                         self.first, static)
        module.clustering = self.plan.clustering if self.plan is not None else self.clustering
        return module

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        matches = find_attention(gm, ctx.model)
        if not matches:
            hidden = hidden_attention(gm, matches)
            message = no_attention_message(gm) + "; the model is left unchanged" + (
                f" (nn.MultiheadAttention left as it is at {', '.join(hidden)})" if hidden else "")
            ctx.log(f"{self.name}: {message}")
            return PassResult(gm, notes=(message,))
        if self.clusters is None and self.plan is None:
            ctx.log(f"{self.name}: {NOT_CALIBRATED}")
            return PassResult(gm, notes=(NOT_CALIBRATED,))
        choices = self._choices(matches)
        hidden = hidden_attention(gm, matches)
        _own_containers(gm, matches)
        every_head = []
        for m, c in zip(matches, choices):
            node, why = _rewrite(gm, m, self._module(m, c))
            if why is not None:
                every_head.append(f"layer {m.index} ({m.scope or '<top>'}): {why}")
            recorded = meta.get_pass_meta(node, self.name) or ()
            meta.set_pass_meta(node, self.name, recorded + (
                ChaiNodeMeta(m.index, m.num_heads, m.num_kv_heads, c.chosen_k),))
        gm.graph.lint()
        gm.recompile()
        plan = self.plan or ChaiPlan(tuple(choices), mode=self.mode, first_tokens=self.first,
                                     clustering=self.clustering)
        if plan.mode != self.mode:
            plan = replace(plan, mode=self.mode)
        artifacts = {"chai_clusters.txt": plan.table(), "chai_elbow.svg": elbow_svg(plan)}
        try:
            with torch.no_grad():
                gm(*ctx.example_inputs)
            artifacts["chai_membership.txt"] = _membership_text(gm)
        except Exception as e:  # inspection only: never fail the pass for it
            artifacts["chai_membership.txt"] = f"sample run failed: {type(e).__name__}: {e}"
        kinds = sorted({m.kind for m in matches})
        notes = (f"{len(matches)} attention layers ({', '.join(kinds)}): {plan.summary()}",)
        if hidden:
            notes += (f"left as they are (cross-attention, or inside a module kept whole): "
                      f"nn.MultiheadAttention at {', '.join(hidden)}",)
        if every_head:
            notes += ("every head's scores computed, probabilities shared after the softmax "
                      "(not through tidal::clustered_attention) at " + "; ".join(every_head),)
        return PassResult(gm, plan=plan, artifacts=artifacts, notes=notes)


# --- offline calibration glue (model runs; the planning itself is in chai_calibrate) ---

def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["logits"]
    return out[0]


def perplexity(run: Callable[..., Any], batches: Sequence[tuple]) -> float:
    """Token-level perplexity of a causal LM ``run(*batch) -> logits`` on ``batches`` of
    ``(input_ids,)``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            ids = batch[0]
            logits = _logits(run(*batch))[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="sum")
            total, count = total + nll.item(), count + ids[:, 1:].numel()
    return math.exp(total / count)


def clustered_graph(model: torch.nn.Module, example_inputs: Any,
                    pass_: Optional[ClusteredAttention] = None) -> fx.GraphModule:
    """``model`` traced and rewritten by ``pass_`` (default: every layer unclustered)."""
    gm = trace(model, example_inputs)
    inputs = bind_inputs(gm, example_inputs, "example_inputs")
    if pass_ is None:
        pass_ = ClusteredAttention(clusters=[None] * len(find_attention(gm, model)))
    result = pass_(gm, PassContext.for_inputs(inputs, model=model))
    if not chai_modules(result.gm):
        raise ValueError(result.notes[0] if result.notes else no_attention_message(gm))
    return result.gm


def calibrate(model: torch.nn.Module, batches: Sequence[tuple], *,
              budget: Budget = Budget(),
              embed: Optional[Callable[[Any, tuple], torch.Tensor]] = None,
              holdout: Optional[float] = 0.5, margin: float = 0.5,
              model_name: str = "the model", log: Callable[[str], None] = lambda m: None,
              mode: str = "budget") -> ChaiPlan:
    """CHAI's offline phase on ``batches`` (tuples of positional inputs, e.g. ``(ids,)``).

    ``mode="paper"`` is the dissertation's rule as written: each layer's k is the elbow of its
    clustering-error curve, and sequences are clustered online by K-means on their first
    tokens' attention (the plan's ``clustering`` is "kmeans"); the budget is only measured
    (``final_metric``, and ``held_out_metric`` on the held-out share), not enforced.
    ``mode="budget"`` (default) is the rule below.

    Collects every layer's clustering-error curve (k = 1..H) and elbow on all ``batches``,
    then chooses each layer's k (``chai_calibrate.choose_counts``): on the batches
    ``split_holdout`` keeps for choosing, under ``budget.tightened(margin)``, verified on the
    share ``holdout`` held out under ``budget`` itself, backing off the last-accepted layers
    (to their mildest useful k, ``chai_calibrate.mildest_useful_k``, then out) until that
    check fits. ``holdout=None``: no check, every batch chooses (still under the tightened
    budget). With ``budget.metric == "cosine"``,
    ``embed(outputs, batch)`` gives the embeddings compared with the original's.
    """
    if mode not in ("budget", "paper"):
        raise ValueError(f"calibrate: mode must be 'budget' or 'paper', got {mode!r}")
    if holdout is None:
        choose_set, check_set = list(batches), []
    else:
        choose_set, check_set = split_holdout(batches, holdout)
    gm = clustered_graph(model, batches[0])
    modules = chai_modules(gm)
    stats = HeadStats()
    for m in modules:
        m.observer = stats.add
    with torch.no_grad():
        for batch in batches:
            gm(*batch)
    for m in modules:
        m.observer = None
    if budget.metric == "cosine":
        if embed is None:
            raise ValueError("calibrate: budget metric 'cosine' needs embed(outputs, batch)")
        with torch.no_grad():
            reference = {id(b): embed(gm(*b), b) for b in batches}

        def metric_on(subset: Sequence[tuple]) -> Callable[[dict], float]:
            def metric(counts: dict) -> float:
                set_counts(gm, counts)
                with torch.no_grad():
                    sims = [F.cosine_similarity(embed(gm(*b), b), reference[id(b)], dim=-1)
                            for b in subset]
                return torch.cat(sims).mean().item()
            return metric
    else:
        def metric_on(subset: Sequence[tuple]) -> Callable[[dict], float]:
            def metric(counts: dict) -> float:
                set_counts(gm, counts)
                return perplexity(gm, subset)
            return metric

    choose_metric = metric_on(choose_set)
    check_metric = metric_on(check_set) if check_set else None
    baseline = choose_metric({})
    check_baseline = check_metric({}) if check_metric else None
    errors = {m.layer: stats.errors(m.layer) for m in modules}
    if mode == "paper":
        return _paper_plan(model, batches, modules, stats, errors, choose_metric, check_metric,
                           baseline, check_baseline, budget, model_name, log)
    mildest = {m.layer: mildest_useful_k(m.num_heads, m.num_kv_heads) for m in modules}
    choice = choose_counts(errors, choose_metric, budget, baseline, log, check=check_metric,
                           check_baseline=check_baseline, margin=margin, mildest=mildest)
    counts = choice.counts
    set_counts(gm, {})
    log(f"{choice.evaluations} evaluations; {budget.metric} {baseline:.4g} -> "
        f"{choice.metric:.4g} (choose split)"
        + (f", {check_baseline:.4g} -> {choice.held_out:.4g} (held out)" if check_set else ""))
    layers = _layer_choices(model, batches, modules, stats, errors, counts)
    rule = (f"{budget.describe()} (chosen under {budget.tightened(margin).describe()} on "
            f"{len(choose_set)} batch(es)"
            + (f", verified on {len(check_set)} held-out batch(es))" if check_set else ")"))
    return ChaiPlan(tuple(layers), budget=rule, baseline_metric=baseline,
                    final_metric=choice.metric, verdict=verdict(layers, model_name),
                    held_out_baseline=check_baseline or 0.0,
                    held_out_metric=choice.held_out if check_set else 0.0,
                    backed_off=choice.backed_off, softened=choice.softened)


def _layer_choices(model: torch.nn.Module, batches: Sequence[tuple], modules: list,
                   stats: HeadStats, errors: dict, counts: dict) -> list[LayerChoice]:
    """Each layer's :class:`LayerChoice` for the chosen ``counts`` (with CHAI-static's
    membership from the averaged similarity)."""
    layers = []
    for m, match in zip(modules, find_attention(trace(model, batches[0]), model)):
        k = counts[m.layer]
        static = static_membership(stats.similarity(m.layer), k, m.kv_of_head) if k else None
        layers.append(LayerChoice(
            m.layer, match.scope, m.num_heads, m.num_kv_heads, match.head_dim, k,
            elbow(errors[m.layer]), errors[m.layer],
            static.labels if static else (), static.representatives if static else ()))
    return layers


def _paper_plan(model, batches, modules, stats, errors, choose_metric, check_metric, baseline,
                check_baseline, budget: Budget, model_name: str,
                log: Callable[[str], None]) -> ChaiPlan:
    """``calibrate(mode="paper")``: k at every layer's elbow, K-means membership online; the
    metric measured with them (on the choosing and the held-out batches), not enforced."""
    counts = {m.layer: elbow(errors[m.layer]) for m in modules}
    for m in modules:
        m.clustering = "kmeans"
    final = choose_metric(counts)
    held = check_metric(counts) if check_metric else 0.0
    log(f"paper: k at the elbow {sorted(counts.items())}; {budget.metric} {baseline:.4g} -> "
        f"{final:.4g}")
    layers = _layer_choices(model, batches, modules, stats, errors, counts)
    return ChaiPlan(tuple(layers), clustering="kmeans",
                    budget=f"paper: each layer's k at its elbow, K-means membership; "
                           f"{budget.describe()} measured, not enforced",
                    baseline_metric=baseline, final_metric=final,
                    verdict=verdict(layers, model_name),
                    held_out_baseline=check_baseline or 0.0, held_out_metric=held)
