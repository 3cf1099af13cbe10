"""A Llama-style decoder-only language model whose state_dict matches HF ``LlamaForCausalLM``.

Parameter names (``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``,
``model.layers.N.mlp.gate_proj.weight``, ``model.layers.N.input_layernorm.weight``,
``model.norm.weight``, ``lm_head.weight``, ...) are Hugging Face's, so e.g. SmolLM2
weights load with ``load_state_dict``. The rotary tables are non-persistent buffers.

KV cache convention: ``past_key_values`` is a tuple with one ``(key, value)``
pair per layer, each ``[B, num_key_value_heads, T_past, head_dim]`` (keys are
stored after RoPE). Use :meth:`LlamaForCausalLM.empty_cache` for a zero-length
cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention_ops import attention_scores, merge_heads, split_heads
from .example_io import CausalLMIO
from .rotary import RotaryEmbedding, apply_rotary_pos_emb
from .weight_init import init_transformer_

KVCache = tuple[tuple[Tensor, Tensor], ...]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama model (HF field names; defaults are SmolLM2-135M)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads


class LlamaRMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (``weight``) and no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Normalise the last dimension to unit RMS (computed in float32) and rescale."""
        input_dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(input_dtype)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated feed-forward block."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with RoPE and explicit matmuls."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        causal_mask: Tensor,
        past_key_value: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attend ``[B, T, hidden]`` over past + current keys.

        ``causal_mask`` is a bool ``[T, T_past + T]`` tensor, True where attention
        is forbidden. Returns the output and the updated ``(key, value)`` cache
        entry ``[B, num_key_value_heads, T_past + T, head_dim]``.
        """
        query = split_heads(self.q_proj(hidden_states), self.num_heads, self.head_dim)
        key = split_heads(self.k_proj(hidden_states), self.num_key_value_heads, self.head_dim)
        value = split_heads(self.v_proj(hidden_states), self.num_key_value_heads, self.head_dim)
        query = apply_rotary_pos_emb(query, cos, sin)
        key = apply_rotary_pos_emb(key, cos, sin)
        if past_key_value is not None:
            key = torch.cat((past_key_value[0], key), dim=2)
            value = torch.cat((past_key_value[1], value), dim=2)
        present = (key, value)
        if self.num_key_value_groups > 1:
            key = key.repeat_interleave(self.num_key_value_groups, dim=1)
            value = value.repeat_interleave(self.num_key_value_groups, dim=1)
        scores = attention_scores(query, key, self.scale)
        probs = scores.masked_fill(causal_mask, float("-inf")).softmax(dim=-1)
        return self.o_proj(merge_heads(probs @ value)), present


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        causal_mask: Tensor,
        past_key_value: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Return the layer output and this layer's updated ``(key, value)`` cache entry."""
        attn_out, present = self.self_attn(
            self.input_layernorm(hidden_states), cos, sin, causal_mask, past_key_value
        )
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


def causal_positions(
    seq_len: int | Tensor, past_length: int | Tensor, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Query positions ``[T]`` and bool mask ``[T, past_length + T]`` after ``past_length`` keys.

    The mask is True where key position > query position (future tokens).
    """
    if isinstance(past_length, int) and past_length == 0:
        key_positions = query_positions = torch.arange(seq_len, device=device)
    else:
        key_positions = torch.arange(past_length + seq_len, device=device)
        query_positions = key_positions[past_length:]
    causal_mask = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
    return query_positions, causal_mask


class LlamaModel(nn.Module):
    """Token embeddings, decoder layers, final RMSNorm and the rotary tables (``rotary_emb``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )

    def forward(
        self, input_ids: Tensor, past_key_values: KVCache | None = None
    ) -> tuple[Tensor, KVCache]:
        """Return final hidden states ``[B, T, hidden]`` and the per-layer updated caches."""
        past_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        positions, causal_mask = causal_positions(input_ids.shape[1], past_length, input_ids.device)
        cos, sin = self.rotary_emb(positions)
        hidden_states = self.embed_tokens(input_ids)
        presents = []
        for index, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[index]
            hidden_states, present = layer(hidden_states, cos, sin, causal_mask, past)
            presents.append(present)
        return self.norm(hidden_states), tuple(presents)


@torch.fx.wrap
def _assert_no_cache(past_key_values: object) -> None:
    """Guard recorded in graphs traced without concrete args: they only implement the no-cache path."""
    if past_key_values is not None:
        raise ValueError("this graph was traced for past_key_values=None; call the eager model")


def _fill_tied_lm_head(module: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    """Load-state-dict pre-hook: supply a missing tied ``lm_head.weight`` from the embeddings.

    HF checkpoints of tied models (e.g. SmolLM2) omit ``lm_head.weight``; this
    lets them load with ``strict=True``.
    """
    head, embed = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
    if head not in state_dict and embed in state_dict:
        state_dict[head] = state_dict[embed]


class LlamaForCausalLM(CausalLMIO, nn.Module):
    """:class:`LlamaModel` (as ``model``) + ``lm_head`` (tied to the embeddings if configured).

    ``forward(input_ids)`` returns logits ``[B, T, vocab]``;
    ``forward(input_ids, past_key_values)`` returns ``(logits, present_key_values)``.
    Under ``torch.fx.symbolic_trace`` without concrete args, ``past_key_values``
    is specialised to None (like ``concrete_args={'past_key_values': None}``).
    """

    def __init__(self, config: LlamaConfig, example_seq_len: int = 128) -> None:
        super().__init__()
        if example_seq_len > config.max_position_embeddings:
            raise ValueError("example_seq_len exceeds max_position_embeddings")
        self.config = config
        self.example_seq_len = example_seq_len
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_transformer_(self, config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.register_load_state_dict_pre_hook(_fill_tied_lm_head)

    def forward(
        self, input_ids: Tensor, past_key_values: KVCache | None = None
    ) -> Tensor | tuple[Tensor, KVCache]:
        """Next-token logits for ``input_ids`` ``[B, T]``, optionally continuing from a KV cache."""
        if isinstance(past_key_values, torch.fx.Proxy):
            _assert_no_cache(past_key_values)
            past_key_values = None
        hidden_states, presents = self.model(input_ids, past_key_values)
        logits = self.lm_head(hidden_states)
        if past_key_values is None:
            return logits
        return logits, presents

    def empty_cache(self, batch_size: int) -> KVCache:
        """A zero-length KV cache (an empty ``(key, value)`` pair per layer) to start cached decoding."""
        weight = self.model.embed_tokens.weight
        shape = (batch_size, self.config.num_key_value_heads, 0, self.config.head_dim)
        return tuple(
            (weight.new_zeros(shape), weight.new_zeros(shape))
            for _ in range(self.config.num_hidden_layers)
        )


def smollm2_135m_config() -> LlamaConfig:
    """The SmolLM2-135M architecture (134,515,008 parameters with tied embeddings); it is
    ``LlamaConfig``'s default."""
    return LlamaConfig()


def llama_small_config() -> LlamaConfig:
    """A tiny Llama: 2 layers, hidden 64, 4 heads, 2 KV heads, FFN 128, vocab 256, 256 positions."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def llama_decoder() -> LlamaForCausalLM:
    """Randomly initialised SmolLM2-135M, example inputs ``[B, 128]`` token ids."""
    return LlamaForCausalLM(smollm2_135m_config(), example_seq_len=128)


def llama_small() -> LlamaForCausalLM:
    """Tiny Llama LM, example inputs ``[B, 16]`` token ids."""
    return LlamaForCausalLM(llama_small_config(), example_seq_len=16)
