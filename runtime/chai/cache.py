"""CHAI's pruned KV cache for Hugging Face ``generate``: K kept only for the KV heads that
representative heads read (dissertation ch. 6, §6.2.4), V whole.

``ClusteredKCache(plan)`` is a ``transformers.DynamicCache`` (so ``generate`` keeps it and reads
its length as it does a ``DynamicCache``'s; the K/V it holds are where that version keeps them,
``layers[i].keys``/``.values`` in transformers 5, ``key_cache``/``value_cache`` in 4.47, through
``tidal.runtime.chai.hf_compat``) that also does each layer's attention: the clustered attention
modules of ``tidal.runtime.chai.generate`` call ``cache.attend(layer, q, k, v, attention_mask,
scale)`` instead of ``update`` followed by attention. Per sequence of the batch, per clustered
layer:

- the first ``plan.first_tokens`` (5) real tokens (after any left padding) use every head; their
  attention probabilities decide the sequence's membership (``head_clusters.
  sequence_memberships``, the function the graph and ``ChaiDecoder`` use; or the plan's offline
  membership in static mode), fixed for the rest of the sequence;
- every later query row computes scores only for the sequence's representative heads and each
  head multiplies its representative's probabilities with its own V (the prompt through
  ``tidal.ir.clustered_attention_math``, as the graph computes it);
- once every sequence of the batch has its membership, K is cut to the KV heads the
  representatives read (``tidal.ir.representative_k_cache``, the layout and decode step
  ``ChaiDecoder`` uses too): ``[B, G', T, D]`` with ``G'`` the most KV heads any sequence of
  the batch keeps (a sequence keeping fewer repeats its first kept head in the spare slots),
  in each sequence's own order. Under multi-head attention ``G'`` is exactly ``k``.

Layers the plan leaves unclustered (``chosen_k`` None) keep K and V whole and run
``scaled_dot_product_attention``. With one head per cluster the result is the model's own
attention. Padding must be on the left (what decoder-only ``generate`` wants); a mask with holes
or right padding is refused with a ``ValueError``. Beam search, contrastive search and
assisted decoding (which reorder, split or crop the cache) are refused.

Example:
    >>> import torch
    >>> from tidal.ir.plans.chai import ChaiPlan, LayerChoice
    >>> from tidal.runtime.chai.cache import ClusteredKCache
    >>> plan = ChaiPlan((LayerChoice(0, "attn", num_heads=4, num_kv_heads=4, head_dim=8,
    ...                              chosen_k=2, elbow_k=2),))
    >>> cache = ClusteredKCache(plan)
    >>> q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8)
    >>> cache.attend(0, q, k, v, None, 8 ** -0.5).shape
    torch.Size([1, 4, 9, 8])
    >>> cache[0][0].shape, cache[0][1].shape   # (K, V): K of 2 of the 4 heads
    (torch.Size([1, 2, 9, 8]), torch.Size([1, 4, 9, 8]))
    >>> cache.get_seq_length()
    9
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tidal.ir.clustered_attention_math import (clustered_rows, first_rows,
                                               first_rows_attention, rep_of_heads, repeat_kv,
                                               share_probs)
from tidal.ir.clustered_attention_op import apply_mask
from tidal.ir.head_clusters import Membership, sequence_memberships
from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.ir.representative_k_cache import (KCacheLayout, k_cache_layout, keep_kv_heads,
                                             representatives_step)
from tidal.runtime.chai import hf_compat


@dataclass
class _LayerState:
    """One clustered layer's per-sequence progress: the fixed memberships (None: still in its
    first tokens), the first rows' probabilities ``[B, H, first, first]`` of sequences still
    open, and the pruned layout once every sequence is fixed."""

    memberships: list[Optional[Membership]]
    first_rows: Optional[torch.Tensor] = None
    layout: Optional[KCacheLayout] = None


def _kept(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" of an HF attention mask (bool: True keeps; float: additive, the
    dtype's minimum or -inf masks)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def left_pads(mask: Optional[torch.Tensor], batch: int, keys: int) -> list[int]:
    """Each sequence's count of left-padding positions, from a 4-D attention mask
    ``[B or 1, 1 or H, Tq, >= keys]`` of the first forward: the leading key columns no query
    row may attend. A left-padding row attends nothing (transformers 5, 4.47 on the CPU) or,
    where a version un-masks it for the fused kernels (4.47 on CUDA), everything, future
    columns included: rows that may attend a column after their own position are not read.
    A sliding window hides early columns from late rows only. ``ValueError`` for holes or
    right padding.

    Example:
        >>> m = torch.zeros(2, 1, 1, 4)
        >>> m[1, ..., :2] = torch.finfo(m.dtype).min
        >>> left_pads(m, 2, 4)
        [0, 2]
    """
    if mask is None:
        return [0] * batch
    if mask.dim() != 4:
        raise ValueError(f"ClusteredKCache: expected a 4-D attention mask, got shape "
                         f"{tuple(mask.shape)}")
    kept = _kept(mask[..., :keys]).any(dim=1)                            # [B or 1, Tq, K]
    rows = kept.shape[1]
    future = torch.arange(keys, device=mask.device) > \
        torch.arange(keys - rows, keys, device=mask.device)[:, None]     # [Tq, K]
    causal_rows = ~(kept & future).any(dim=-1, keepdim=True)
    seen = (kept & causal_rows).any(dim=1).expand(batch, keys)
    pads = []
    for b, row in enumerate(seen.tolist()):
        pad = row.index(True) if True in row else keys
        if not all(row[pad:]):
            raise ValueError(f"ClusteredKCache: sequence {b}'s attention mask has holes or "
                             f"right padding ({row}); pad on the left (tokenizer.padding_side"
                             f" = 'left') as decoder-only generation needs; without an attention_mask, "
                             f"generate masks every prompt token equal to pad_token_id")
        pads.append(pad)
    return pads


GROWTH = 64
"""Tokens a layer's K/V buffer grows by beyond what it holds (see ``ClusteredKCache.stores``)."""


class ClusteredKCache(DynamicCache):
    """A ``DynamicCache`` holding, for each layer the ``plan`` clusters, K only for the KV heads
    its representatives read (see the module docstring); layers are the plan's layer
    indices."""

    def __init__(self, plan: ChaiPlan) -> None:
        super().__init__()
        self.plan = plan
        self.specs: dict[int, LayerChoice] = {c.layer: c for c in plan.layers}
        self.first = plan.first_tokens
        self.pads: Optional[list[int]] = None
        self.states: dict[int, _LayerState] = {}
        self.stores: dict[tuple[int, str], torch.Tensor] = {}
        """(layer, "k" or "v") -> the buffer whose first positions the layer's K / V view: a
        step writes its token in place instead of copying the whole cache (``torch.cat``,
        what ``DynamicCache`` does); it grows by ``GROWTH``."""

    # --- what generate and the models read ---
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: D401
        raise TypeError(
            f"ClusteredKCache: layer {layer_idx} called update(): it is running the model's own "
            f"attention, which would attend with K heads the cache no longer holds. Generate "
            f"with compiled.generate(...) or tidal.runtime.chai.generate.generation_model(...), "
            f"whose attention calls ClusteredKCache.attend")

    def __getitem__(self, layer_idx: int) -> "LayerView":
        """``(K, V)`` of one layer (empty tensors before its first token, on the device of
        what the cache holds), which is what models with tuple caches (GPT-2, OPT in
        transformers 4.47) index."""
        held = hf_compat.layer_kv(self, layer_idx)
        if held is not None:
            return LayerView(self, layer_idx, *held)
        other = next((v for _, v in hf_compat.layers_kv(self) if v.numel()), None)
        empty = torch.empty(0, 0, 0, 0, device=None if other is None else other.device)
        return LayerView(self, layer_idx, empty, empty)

    def __iter__(self):
        return (self[i] for i in range(len(hf_compat.layers_kv(self))))

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        held = None if layer_idx is None else hf_compat.layer_kv(self, layer_idx)
        return 0 if held is None else int(held[1].shape[-2])

    def _refuse(self, what: str) -> None:
        raise NotImplementedError(f"ClusteredKCache: {what} is not supported (each sequence's "
                                  f"clusters live in the cache); use greedy or sampling")

    def reorder_cache(self, beam_idx):
        self._refuse("beam search (reorder_cache)")

    def crop(self, max_length):
        self._refuse("cropping the cache (assisted decoding)")

    def batch_split(self, full_batch_size, split_size, num_hidden_layers=None):
        self._refuse("splitting the cache (contrastive search)")

    def batch_repeat_interleave(self, repeats):
        self._refuse("repeating the batch (beam search / num_return_sequences)")

    def batch_select_indices(self, indices):
        self._refuse("selecting batch rows")

    # --- what tidal reads ---
    def k_cache_bytes(self) -> int:
        """Bytes of K held, every layer (the buffers behind them have room for up to
        ``GROWTH`` more tokens per layer)."""
        return k_bytes(self)

    def v_cache_bytes(self) -> int:
        """Bytes of V held, every layer."""
        return sum(v.numel() * v.element_size() for _, v in hf_compat.layers_kv(self))

    def memberships(self, layer: int) -> list[Optional[Membership]]:
        """Layer ``layer``'s membership per sequence (None: unclustered, or still in its first
        tokens)."""
        state = self.states.get(layer)
        if state is None:
            return [None] * (len(self.pads) if self.pads else 0)
        return list(state.memberships)

    # --- attention ---
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """Append ``key``/``value`` ``[B, Hkv, Tq, D]`` of the new tokens to layer ``layer``
        and return the attention of ``query`` ``[B, H, Tq, D]`` over every cached position
        (``attention_mask``: the model's additive or boolean 4-D mask, or None for causal)."""
        spec = self.specs.get(layer)
        if spec is None:
            raise KeyError(f"ClusteredKCache: layer {layer} is not in the plan (layers "
                           f"{sorted(self.specs)})")
        past = self.get_seq_length(layer)
        b, _, tq, _ = query.shape
        tk = past + tq
        if past and tq != 1:
            raise NotImplementedError(f"ClusteredKCache: layer {layer}: {tq} new tokens on top "
                                      f"of {past} cached ones (chunked prefill) is not supported")
        if self.pads is None:
            self.pads = left_pads(attention_mask, b, tk)
        if len(self.pads) != b:
            raise ValueError(f"ClusteredKCache: batch of {b} after a batch of {len(self.pads)}")
        mask = None if attention_mask is None else attention_mask[..., :tk]
        if mask is not None and not past:
            mask = _attend_somewhere(mask)
        if spec.chosen_k is None:
            keys, values = self._append(layer, key, value, None)
            return F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None and tq > 1,
                scale=scale, enable_gqa=spec.num_heads != spec.num_kv_heads)
        if not past:
            return self._prefill(layer, spec, query, key, value, mask, scale)
        return self._step(layer, spec, query, key, value, mask, scale)

    def _append(self, layer: int, key, value, kv_keep: Optional[torch.Tensor]):
        """Concatenate the new K (only the kept KV heads when ``kv_keep``) and V."""
        if layer == 0:
            hf_compat.count_seen(self, value.shape[2])
        if kv_keep is not None:
            key = keep_kv_heads(key, kv_keep)
        held = hf_compat.layer_kv(self, layer)
        keys = self._write(layer, "k", None if held is None else held[0], key)
        values = self._write(layer, "v", None if held is None else held[1], value)
        hf_compat.set_layer_kv(self, layer, keys, values)  # placeholders on value's device
        return keys, values

    def _write(self, layer: int, which: str, held: Optional[torch.Tensor], new: torch.Tensor
               ) -> torch.Tensor:
        """``held`` ``[B, heads, n, D]`` (None: nothing yet) followed by ``new``, written into
        the layer's buffer (a larger one, ``held`` copied once, when it is full or its heads
        changed)."""
        used = 0 if held is None else held.shape[2]
        need = used + new.shape[2]
        store = self.stores.get((layer, which))
        if store is None or store.shape[2] < need or store.shape[:2] != new.shape[:2]:
            store = new.new_empty(*new.shape[:2], need + GROWTH, new.shape[3])
            if used:
                store[:, :, :used] = held
            self.stores[(layer, which)] = store
        store[:, :, used:need] = new
        return store[:, :, :need]

    def _membership(self, spec: LayerChoice, probs: torch.Tensor) -> Membership:
        """A sequence's membership from its first rows' probabilities ``[H, first, first]``
        (``tidal.ir.head_clusters.sequence_memberships``, the graph's rule)."""
        static = Membership(spec.static_labels, spec.static_reps) \
            if self.plan.mode == "static" else None
        return sequence_memberships(probs[None], spec.chosen_k, spec.kv_of_head, self.first,
                                    self.plan.clustering, static)[0]

    def _prefill(self, layer: int, spec: LayerChoice, q, k, v, mask, scale) -> torch.Tensor:
        """Attention over a prompt from an empty cache: each sequence's first real rows with
        every head (its membership), the rest through ``tidal::clustered_attention``."""
        b, h, t, _ = q.shape
        first, pads = self.first, self.pads
        rows = first_rows(pads, first, t, q.device)                          # [B, F]
        probs, heads = first_rows_attention(q, k, v, scale, rows, causal=True, mask=mask)
        state = _LayerState([None] * b, q.new_zeros(b, h, first, first))
        for i, pad in enumerate(pads):
            real = min(t - pad, first)
            state.first_rows[i, :, :real, :real] = probs[i, :, :real, pad:pad + real]
            if real == first:
                state.memberships[i] = self._membership(spec, state.first_rows[i])
        self.states[layer] = state
        out = clustered_rows(q, k, v, rep_of_heads(state.memberships, h, q.device), scale,
                             True, mask, rows, heads)
        self._append(layer, k, v, None)
        self._prune_if_fixed(layer, spec, q.device)
        return out

    def _step(self, layer: int, spec: LayerChoice, q, k, v, mask, scale) -> torch.Tensor:
        """One new token per sequence over the cache."""
        state = self.states[layer]
        lay = state.layout
        if lay is not None and not lay.whole:
            keys, values = self._append(layer, k, v, lay.kv_keep)
            return representatives_step(q, keys, values, lay, mask, scale)
        keys, values = self._append(layer, k, v, None)
        b, h, _, d = q.shape
        n = keys.shape[2]
        group = h // keys.shape[1]
        scores = q @ repeat_kv(keys, h).transpose(-1, -2) * scale
        probs = apply_mask(scores, mask).softmax(dim=-1)                     # [B, H, 1, n]
        rep = rep_of_heads(state.memberships, h, q.device)                   # before fixing
        shared = share_probs(probs, rep)
        for i, pad in enumerate(self.pads if lay is None else ()):
            j = n - 1 - pad                               # this token's index among the real
            if state.memberships[i] is None and j < self.first:
                state.first_rows[i, :, j, :j + 1] = probs[i, :, 0, pad:pad + j + 1]
                if j + 1 == self.first:
                    state.memberships[i] = self._membership(spec, state.first_rows[i])
        out = shared.view(b, keys.shape[1], group, n) @ values
        self._prune_if_fixed(layer, spec, q.device)
        return out.view(b, h, 1, d)

    def _prune_if_fixed(self, layer: int, spec: LayerChoice, device) -> None:
        """Once every sequence has its membership: K cut to the kept KV heads."""
        state = self.states[layer]
        if state.layout is not None or any(m is None for m in state.memberships):
            return
        state.layout = k_cache_layout(state.memberships, spec.kv_of_head, device)
        state.first_rows = None
        if state.layout.whole:
            return
        keys, values = hf_compat.layer_kv(self, layer)
        hf_compat.set_layer_kv(self, layer, keep_kv_heads(keys, state.layout.kv_keep), values)
        self.stores.pop((layer, "k"), None)  # the full-width buffer is freed


def k_bytes(cache) -> int:
    """Bytes of K a ``DynamicCache`` (a ``ClusteredKCache`` or Hugging Face's own, either
    transformers version) holds, every layer.

    Example:
        >>> from transformers import DynamicCache
        >>> k_bytes(DynamicCache())
        0
    """
    return sum(k.numel() * k.element_size() for k, _ in hf_compat.layers_kv(cache))


class LayerView(tuple):
    """``(K, V)`` of one layer of a :class:`ClusteredKCache`, which models with tuple caches
    pass back to their attention as ``layer_past``; ``cache`` and ``layer`` lead back."""

    cache: ClusteredKCache
    layer: int

    def __new__(cls, cache: ClusteredKCache, layer: int, key: torch.Tensor,
                value: torch.Tensor) -> "LayerView":
        view = super().__new__(cls, (key, value))
        view.cache, view.layer = cache, layer
        return view


def _attend_somewhere(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with each query row that may attend nothing (a left-padding position under a
    boolean mask, transformers 5's sdpa) let attend everything: its softmax would be NaN, and
    NaN in a padding position's K/V reaches every real row (0 x NaN), where the model's own
    kernel returns finite values. Real rows are unchanged; padding rows are never attended.

    Example:
        >>> m = torch.tensor([[False, False], [False, True]])[None, None]
        >>> _attend_somewhere(m)[0, 0].tolist()
        [[True, True], [False, True]]
    """
    dead = ~_kept(mask).any(dim=-1, keepdim=True)
    if mask.dtype == torch.bool:
        return mask | dead
    return mask.masked_fill(dead, 0.0)
