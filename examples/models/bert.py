"""A BERT encoder + sequence classifier with Hugging Face ``BertModel`` module names.

Attention is written with explicit matmuls (see :mod:`.attention_ops`). There
is no attention/padding mask: every input position is attended to, token-type
ids are all zero and positions are ``arange(seq_len)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention_ops import attention_scores, merge_heads, split_heads
from .example_io import SequenceClassifierIO
from .weight_init import init_transformer_


@dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder (defaults are bert-base-uncased, 2 labels)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    num_labels: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Embed token ids ``[B, T]`` into hidden states ``[B, T, hidden]``."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        token_type_ids = torch.zeros_like(input_ids)
        embeddings = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(position_ids)
        )
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with separate query/key/value projections and explicit matmuls."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Return the concatenated per-head contexts ``[B, T, hidden]``."""
        heads, size = self.num_attention_heads, self.attention_head_size
        query = split_heads(self.query(hidden_states), heads, size)
        key = split_heads(self.key(hidden_states), heads, size)
        value = split_heads(self.value(hidden_states), heads, size)
        probs = attention_scores(query, key, self.scale).softmax(dim=-1)
        probs = self.dropout(probs)
        return merge_heads(probs @ value)


class BertSelfOutput(nn.Module):
    """Attention output projection, dropout, residual add and LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        """Project ``hidden_states`` and add it to the residual ``input_tensor``."""
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    """Self-attention (``self``) followed by its output block (``output``)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Attention sub-layer with residual connection."""
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    """Feed-forward expansion: dense to ``intermediate_size`` + GELU."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Expand and activate."""
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    """Feed-forward contraction back to ``hidden_size``, dropout, residual add and LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        """Contract ``hidden_states`` and add it to the residual ``input_tensor``."""
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertLayer(nn.Module):
    """One post-LN transformer encoder layer: attention, intermediate, output."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Apply the attention and feed-forward sub-layers."""
        attention_output = self.attention(hidden_states)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    """A stack of ``num_hidden_layers`` :class:`BertLayer` in ``layer``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Apply every layer in order."""
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertPooler(nn.Module):
    """Dense + tanh on the first token's hidden state."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Pool ``[B, T, hidden]`` to ``[B, hidden]``."""
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    """Embeddings, encoder and pooler; returns the pooled output ``[B, hidden]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Encode token ids ``[B, T]`` and pool them to ``[B, hidden]``."""
        return self.pooler(self.encoder(self.embeddings(input_ids)))


class BertForSequenceClassification(SequenceClassifierIO, nn.Module):
    """:class:`BertModel` (as ``bert``) + dropout + linear ``classifier``.

    ``forward(input_ids [B, T]) -> logits [B, num_labels]``.
    """

    def __init__(self, config: BertConfig, example_seq_len: int = 128) -> None:
        super().__init__()
        if example_seq_len > config.max_position_embeddings:
            raise ValueError("example_seq_len exceeds max_position_embeddings")
        self.config = config
        self.example_seq_len = example_seq_len
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        init_transformer_(self, config.initializer_range)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Classify token ids ``[B, T]`` into logits ``[B, num_labels]``."""
        return self.classifier(self.dropout(self.bert(input_ids)))


def bert_base_config() -> BertConfig:
    """bert-base-uncased sizes: 12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522, 2 labels."""
    return BertConfig()


def bert_small_config() -> BertConfig:
    """A tiny BERT: 2 layers, hidden 64, 4 heads, FFN 256, vocab 1000, no dropout."""
    return BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def bert_base() -> BertForSequenceClassification:
    """bert-base sequence classifier, example inputs ``[B, 128]`` token ids."""
    return BertForSequenceClassification(bert_base_config(), example_seq_len=128)


def bert_small() -> BertForSequenceClassification:
    """Tiny BERT sequence classifier, example inputs ``[B, 16]`` token ids."""
    return BertForSequenceClassification(bert_small_config(), example_seq_len=16)
