"""tidal's own decode step for Llama-architecture LMs, with CHAI clustered attention.

``ChaiDecoder(model, plan=...)`` reads the weights of the zoo ``LlamaForCausalLM`` or Hugging
Face's ``LlamaForCausalLM`` (same parameter names) and runs greedy generation with a static,
preallocated KV cache: fused QKV and gate/up projections, no per-step allocation of the cache.
The rotary base comes from the config (transformers 5's ``rope_parameters``, 4.47's
``rope_theta``, through ``tidal.runtime.chai.hf_compat.rope``); scaled or partial rotary
embeddings are refused by name.

Layers with a cluster count k (from a ``ChaiPlan`` or ``counts``) follow the
``clustered_attention`` semantics: the first ``first_tokens`` (5) prompt tokens use every head;
their attention (5×5 per head) decides the membership (online; or the plan's offline
membership in static mode, CHAI-static), fixed for the rest of the sequence; after that, scores
are computed only for each cluster's representative head and shared with its members, V is kept
for every head, and the K cache holds only the KV heads that representatives read (under
grouped-query attention, a KV head is dropped when no representative uses it). With k = H (or no
plan) the logits equal the original model's. The prompt's attention is the graph's
(``tidal.ir.clustered_attention_math``), the pruned K cache and its decode step those of Hugging
Face generation (``tidal.ir.representative_k_cache``); what is the decoder's own is its layers,
rotary embedding and static cache.

Online membership is per sequence, so clustered online decoding takes one sequence at a time
(batch 1); static mode and unclustered decoding take any batch.

The decoder runs where the model's weights are (``ChaiDecoder.device``, in their dtype): the
rotary tables, the masks, the cache and the cluster index tensors are made there; token ids on
another device are refused by name, and so is a model whose weights sit on several devices.

Example:
    >>> import torch
    >>> from examples.models import llama_small
    >>> from tidal.runtime.chai.decode import ChaiDecoder
    >>> model = llama_small().eval()
    >>> ids = torch.randint(0, 256, (1, 12))
    >>> full = ChaiDecoder(model)
    >>> full.generate(ids, 4).shape
    torch.Size([1, 16])
    >>> torch.allclose(full.prefill(ids)[0], model(ids), atol=1e-5)   # the model's logits
    True
    >>> chai = ChaiDecoder(model, counts=1)   # one cluster per layer
    >>> state = chai.prefill(ids)[1]
    >>> chai.k_cache_bytes(state) * 2 == full.k_cache_bytes(full.prefill(ids)[1])
    True
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from tidal.ir.clustered_attention_math import (clustered_rows, first_rows,
                                               first_rows_attention, rep_of_heads)
from tidal.ir.head_clusters import (FIRST_TOKENS, Membership, check_count, kv_head_map,
                                    sequence_memberships)
from tidal.ir.plans.chai import ChaiPlan
from tidal.ir.representative_k_cache import (KCacheLayout, k_cache_layout, keep_kv_heads,
                                             representatives_step)
from tidal.runtime.chai import hf_compat


@dataclass
class _Layer:
    """One decoder layer's weights (fused where it helps)."""

    ln1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ln2: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass
class DecodeState:
    """The static KV cache of one generation: per layer K (only kept KV heads once clustered)
    and V ``[B, KV, max_len, D]``, the filled length, and each layer's clusters (the layout
    of its pruned K cache, ``tidal.ir.representative_k_cache``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0
    clusters: list[Optional[KCacheLayout]] = field(default_factory=list)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ChaiDecoder:
    """Greedy decoding for a Llama-architecture LM with optional clustered attention.

    ``plan`` (a ``ChaiPlan``) or ``counts`` (one k, or one k/None per layer) give the clusters;
    ``mode`` "online" or "static" (the plan's offline membership).
    """

    def __init__(self, model: torch.nn.Module, plan: Optional[ChaiPlan] = None,
                 counts: Union[int, Sequence[Optional[int]], None] = None,
                 mode: Optional[str] = None) -> None:
        cfg = model.config
        rope = hf_compat.rope(cfg)
        if rope.kind != "default" or rope.partial != 1.0:
            raise ValueError(f"ChaiDecoder: only plain rotary embeddings are supported; "
                             f"{type(cfg).__name__} has rope type {rope.kind!r} rotating "
                             f"{rope.partial:g} of each head")
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // self.heads
        if (getattr(cfg, "head_dim", None) or self.head_dim) != self.head_dim:
            raise ValueError(f"ChaiDecoder: head_dim {cfg.head_dim} is not hidden_size / heads "
                             f"({self.head_dim})")
        self.eps = cfg.rms_norm_eps
        self.theta = rope.theta
        self.max_positions = cfg.max_position_embeddings
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach(),
                torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).detach(),
                a.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                torch.cat((m.gate_proj.weight, m.up_proj.weight)).detach(),
                m.down_proj.weight.detach()))
        self.device = self.embed.device
        _check_one_device(self)
        self.kv_of_head = kv_head_map(self.heads, self.kv_heads)
        steps = torch.arange(0, self.head_dim, 2, device=self.device).float()
        self.inv_freq = 1.0 / self.theta ** (steps / self.head_dim)
        self._set_clusters(plan, counts, mode)

    def _set_clusters(self, plan: Optional[ChaiPlan],
                      counts: Union[int, Sequence[Optional[int]], None],
                      mode: Optional[str]) -> None:
        """Each layer's cluster count (and static membership) from ``plan`` or ``counts``."""
        self.first = plan.first_tokens if plan is not None else FIRST_TOKENS
        self.mode = mode or (plan.mode if plan is not None else "online")
        self.clustering = plan.clustering if plan is not None else "linkage"
        self.static: list[Optional[Membership]] = [None] * len(self.layers)
        if plan is not None:
            if len(plan.layers) != len(self.layers):
                raise ValueError(f"ChaiDecoder: plan has {len(plan.layers)} layers, the model "
                                 f"{len(self.layers)}")
            self.counts = [c.chosen_k for c in plan.layers]
            if self.mode == "static":
                self.static = [Membership(c.static_labels, c.static_reps) if c.chosen_k else None
                               for c in plan.layers]
        elif counts is None or isinstance(counts, int):
            self.counts = [counts] * len(self.layers)
        else:
            self.counts = list(counts)
            if len(self.counts) != len(self.layers):
                raise ValueError(f"ChaiDecoder: {len(self.counts)} counts for "
                                 f"{len(self.layers)} layers")
        for i, k in enumerate(self.counts):
            if k is not None:
                check_count(k, self.heads, f"layer {i}")

    def with_clusters(self, plan: Optional[ChaiPlan] = None,
                      counts: Union[int, Sequence[Optional[int]], None] = None,
                      mode: Optional[str] = None) -> "ChaiDecoder":
        """A decoder with other clusters that shares this one's weight tensors (no copy).

        Comparing decoders built this way times only what differs, the attention: separately
        fused copies of the weights can differ by several percent in speed by where they sit
        in memory.

        Example:
            >>> from examples.models import llama_small
            >>> full = ChaiDecoder(llama_small().eval())
            >>> one = full.with_clusters(counts=1)
            >>> one.lm_head is full.lm_head, one.counts[0], full.counts[0]
            (True, 1, None)
        """
        other = copy.copy(self)
        other._set_clusters(plan, counts, mode)
        return other

    # --- helpers ---
    def _check_tokens(self, ids: torch.Tensor, name: str) -> None:
        """``ValueError`` unless the token ids ``ids`` are on the weights' device."""
        if ids.device != self.device:
            raise ValueError(f"ChaiDecoder: {name} is on {ids.device} but the model's weights "
                             f"are on {self.device}; move it there (.to({str(self.device)!r}))")

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float32, device=self.inv_freq.device)
        ang = torch.outer(pos, self.inv_freq)
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos().to(self.embed.dtype), ang.sin().to(self.embed.dtype)

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        """An empty static cache for ``batch`` sequences of up to ``max_len`` tokens."""
        if max_len > self.max_positions:
            raise ValueError(f"ChaiDecoder: max_len {max_len} exceeds the model's "
                             f"{self.max_positions} positions")
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        return DecodeState([self.embed.new_zeros(shape) for _ in self.layers],
                           [self.embed.new_zeros(shape) for _ in self.layers], 0,
                           [None] * len(self.layers))

    def k_cache_bytes(self, state: DecodeState) -> int:
        """Bytes of the K cache as held (all positions allocated)."""
        return sum(k.numel() * k.element_size() for k in state.keys)

    # --- attention ---
    def _prefill_attention(self, i: int, q, k, v, state: DecodeState) -> torch.Tensor:
        """Causal attention over the prompt; fixes layer ``i``'s clusters when it has a count:
        the first tokens with every head, the rest scored for the representatives only
        (``tidal.ir.clustered_attention_math``, as the graph computes it)."""
        b, t = q.shape[0], q.shape[2]
        if self.counts[i] is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.heads != self.kv_heads)
        if t <= self.first:
            raise ValueError(f"ChaiDecoder: clustered layers need a prompt longer than "
                             f"{self.first} tokens (got {t})")
        if self.static[i] is None and b != 1:
            raise ValueError("ChaiDecoder: online membership is per sequence; decode one "
                             "sequence at a time (batch 1) or use mode='static'")
        scale = 1 / math.sqrt(self.head_dim)
        rows = first_rows([0] * b, self.first, t, q.device)
        probs, heads_out = first_rows_attention(q, k, v, scale, rows, causal=True)
        mem = self.first_token_membership(i, probs)
        state.clusters[i] = k_cache_layout([mem] * b, self.kv_of_head, self.device)
        return clustered_rows(q, k, v, rep_of_heads([mem] * b, self.heads, q.device), scale,
                              True, None, rows, heads_out)

    def first_token_membership(self, i: int, probs: torch.Tensor) -> Membership:
        """Layer ``i``'s membership: the plan's in static mode, else the first sequence's from
        the attention probabilities of its first tokens ``probs`` ``[B, H, first, Tk]``
        (``tidal.ir.head_clusters.sequence_memberships``, the function the graph uses)."""
        return sequence_memberships(probs[:1], self.counts[i], self.kv_of_head, self.first,
                                    self.clustering, self.static[i])[0]

    def _step_attention(self, i: int, q, state: DecodeState, n: int) -> torch.Tensor:
        """One query token ``q`` ``[B, H, 1, D]`` over the ``n`` cached positions."""
        b = q.shape[0]
        group = self.heads // self.kv_heads
        keys, values = state.keys[i][:, :, :n], state.values[i][:, :, :n]
        scale = 1 / math.sqrt(self.head_dim)
        cl = state.clusters[i]
        if cl is None:
            qg = q.view(b, self.kv_heads, group, self.head_dim)
            probs = (qg @ keys.transpose(-1, -2) * scale).softmax(-1)
            return (probs @ values).reshape(b, self.heads, 1, self.head_dim)
        return representatives_step(q, keys, values, cl, None, scale)

    # --- model ---
    def _qkv(self, layer: _Layer, x: torch.Tensor, cos, sin):
        b, t, _ = x.shape
        h, g, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_rms(x, layer.ln1, self.eps), layer.wqkv)
        q, k, v = qkv.split((h * d, g * d, g * d), dim=-1)
        q = _rotate(q.view(b, t, h, d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, t, g, d).transpose(1, 2), cos, sin)
        return q, k, v.view(b, t, g, d).transpose(1, 2)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(_rms(x, layer.ln2, self.eps), layer.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(x, self.norm, self.eps), self.lm_head)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, max_len: Optional[int] = None, *,
                last_only: bool = False) -> tuple[torch.Tensor, DecodeState]:
        """Run the prompt; returns the logits of every prompt position (``last_only``: of the
        last one, ``[B, 1, vocab]``) and the cache (sized ``max_len``, default the prompt
        length + 64)."""
        self._check_tokens(input_ids, "input_ids")
        b, t = input_ids.shape
        state = self.new_state(b, max_len or min(t + 64, self.max_positions))
        cos, sin = self._rope(0, t)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            attn = self._prefill_attention(i, q, k, v, state)
            cl = state.clusters[i]
            if cl is not None:   # keep only the KV heads representatives read
                state.keys[i] = keep_kv_heads(state.keys[i], cl.kv_keep)
                k = keep_kv_heads(k, cl.kv_keep)
            state.keys[i][:, :, :t] = k
            state.values[i][:, :, :t] = v
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), layer.wo)
            x = self._mlp(layer, x)
        state.length = t
        return self._logits(x[:, -1:] if last_only else x), state

    @torch.inference_mode()
    def step(self, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Feed one token per sequence ``[B, 1]``; returns its logits ``[B, 1, vocab]``."""
        self._check_tokens(token, "token")
        b = token.shape[0]
        pos = state.length
        if pos >= state.values[0].shape[2]:
            raise ValueError(f"ChaiDecoder: the cache is full ({pos} positions)")
        cos, sin = self._rope(pos, 1)
        x = F.embedding(token, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cl = state.clusters[i]
            state.keys[i][:, :, pos:pos + 1] = k if cl is None else keep_kv_heads(k, cl.kv_keep)
            state.values[i][:, :, pos:pos + 1] = v
            attn = self._step_attention(i, q, state, pos + 1)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, 1, -1), layer.wo)
            x = self._mlp(layer, x)
        state.length = pos + 1
        return self._logits(x)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedily append ``max_new_tokens`` tokens to ``input_ids`` ``[B, T]``."""
        if max_new_tokens <= 0:
            return input_ids
        logits, state = self.prefill(input_ids, input_ids.shape[1] + max_new_tokens,
                                     last_only=True)
        tokens = [input_ids]
        for n in range(max_new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            if n + 1 < max_new_tokens:
                logits = self.step(nxt, state)
        return torch.cat(tokens, dim=1)

    def memberships(self, state: DecodeState) -> list[Optional[Membership]]:
        """Each layer's fixed membership in ``state`` (None: unclustered)."""
        return [None if c is None else c.memberships[0] for c in state.clusters]


def _check_one_device(dec: ChaiDecoder) -> None:
    """``ValueError`` unless every weight ``dec`` read is on the embedding's device."""
    weights = {"lm_head": dec.lm_head, "model.norm": dec.norm}
    for i, layer in enumerate(dec.layers):
        weights.update({f"layer {i} {name}": getattr(layer, name)
                        for name in layer.__dataclass_fields__})
    elsewhere = {name: w.device for name, w in weights.items() if w.device != dec.device}
    if elsewhere:
        name, device = next(iter(elsewhere.items()))
        raise ValueError(f"ChaiDecoder: the weights must be on one device; the embedding is on "
                         f"{dec.device}, {name} on {device} ({len(elsewhere)} tensor(s) "
                         f"elsewhere)")


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             plan: Optional[ChaiPlan] = None,
             counts: Union[int, Sequence[Optional[int]], None] = None,
             mode: Optional[str] = None) -> torch.Tensor:
    """Greedy generation with CHAI for the zoo LM or Hugging Face Llama (see ``ChaiDecoder``)."""
    return ChaiDecoder(model, plan, counts, mode).generate(input_ids, max_new_tokens)
