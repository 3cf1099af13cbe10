"""Builders of the third-party models: tiny configs, random weights, no downloads.

Each builder returns a :class:`Case`: the model (``eval()``, so no dropout), its example
inputs (a dict of keyword inputs for Hugging Face models, a tuple for ``torch.nn`` models),
the targets of the global batch, a ``loss_fn(outputs, targets)`` that takes a Hugging Face
``ModelOutput`` (or the dict a traced graph returns) as well as a tensor or tuple, and the
attention layers' head counts (for ``ClusteredAttention(clusters=...)``; empty when the model
has no attention).

    >>> case = BUILDERS["gpt2"]()
    >>> out = case.model(**case.inputs)
    >>> float(case.loss_fn(out, case.targets)) > 0
    True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4
SEQ = 8
VOCAB = 64
CLASSES = 3
IMAGE = 32


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a Hugging Face ``ModelOutput``, a dict, a tuple or a tensor."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if hasattr(outputs, "keys"):  # ModelOutput and the dict a traced HF graph returns
        return outputs["logits"] if "logits" in outputs.keys() else outputs["last_hidden_state"]
    return outputs[0]


def token_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of per-token logits ``(B, T, V)`` against token targets ``(B, T)``."""
    logits = logits_of(outputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def class_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits ``(B, C)`` against class targets ``(B,)``."""
    return F.cross_entropy(logits_of(outputs), targets)


@dataclass
class Case:
    """One model of the matrix, ready to compile."""
    name: str
    model: nn.Module
    inputs: Union[dict, tuple]
    targets: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    heads: list = field(default_factory=list)  # attention heads per attention layer

    def call(self, model: Any = None) -> Any:
        """Run ``model`` (default: the case's own) on the example inputs."""
        model = self.model if model is None else model
        return model(**self.inputs) if isinstance(self.inputs, dict) else model(*self.inputs)


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=_gen(seed))


def _images() -> torch.Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=_gen(2))


def _classes() -> torch.Tensor:
    return torch.randint(0, CLASSES, (BATCH,), generator=_gen(3))


def _hf():
    import transformers  # the hf extra; imported only when a Hugging Face model is built
    transformers.logging.set_verbosity_error()
    return transformers


# -- Hugging Face --------------------------------------------------------------------------
def gpt2() -> Case:
    """Causal LM with learned position embeddings (GPT-2, eager attention)."""
    t = _hf()
    cfg = t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       attn_implementation="eager")
    torch.manual_seed(0)
    ids = _tokens()
    return Case("gpt2", t.GPT2LMHeadModel(cfg).eval(), {"input_ids": ids}, _tokens(11),
                token_loss, [4, 4])


def _causal_lm(name: str, config: str, model: str, heads=(4, 4), **extra) -> Case:
    """A 2-layer decoder LM of ``transformers`` classes ``config`` / ``model`` (4 heads, 2 KV
    heads, eager attention) on the shared token batch; ``extra`` config fields."""
    t = _hf()
    cfg = getattr(t, config)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=32, attn_implementation="eager", **extra)
    torch.manual_seed(0)
    return Case(name, getattr(t, model)(cfg).eval(), {"input_ids": _tokens()}, _tokens(11),
                token_loss, list(heads))


def llama() -> Case:
    """Causal LM with rotary positions and grouped-query attention (4 heads, 2 KV heads)."""
    return _causal_lm("llama", "LlamaConfig", "LlamaForCausalLM")


def qwen2() -> Case:
    """Qwen2: rotary positions, grouped-query attention, biased Q/K/V projections."""
    return _causal_lm("qwen2", "Qwen2Config", "Qwen2ForCausalLM")


def gemma() -> Case:
    """Gemma (transformers.utils.fx never listed it; captured through torch.export like every
    Hugging Face model)."""
    return _causal_lm("gemma", "GemmaConfig", "GemmaForCausalLM", head_dim=8)


def qwen3() -> Case:
    """Qwen3 (transformers 5): RMS-normed queries and keys per head."""
    return _causal_lm("qwen3", "Qwen3Config", "Qwen3ForCausalLM", head_dim=8)


def gemma3() -> Case:
    """Gemma 3 text (transformers 5): sliding-window layers beside global ones, QK norms."""
    return _causal_lm("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8,
                      sliding_window=4)


def olmo2() -> Case:
    """OLMo 2 (transformers 5): norms after attention and MLP, QK norms."""
    return _causal_lm("olmo2", "Olmo2Config", "Olmo2ForCausalLM")


def qwen3_moe() -> Case:
    """Qwen3-MoE (transformers 5): a mixture of 4 experts, 2 per token, in every layer."""
    return _causal_lm("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=8,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1)


def gpt_neox() -> Case:
    """GPT-NeoX (Pythia's architecture; its attention, which transformers.utils.fx could not
    trace, is captured through torch.export: scores from ``baddbmm`` in transformers 4)."""
    t = _hf()
    cfg = t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                          attn_implementation="eager")
    torch.manual_seed(0)
    return Case("gpt_neox", t.GPTNeoXForCausalLM(cfg).eval(), {"input_ids": _tokens()},
                _tokens(11), token_loss, [4, 4])


def bert() -> Case:
    """Encoder with a padding attention mask (BERT sequence classification)."""
    t = _hf()
    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       num_labels=CLASSES, attn_implementation="eager")
    torch.manual_seed(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 5:] = 0  # padding on two rows
    mask[3, 3:] = 0
    return Case("bert", t.BertForSequenceClassification(cfg).eval(),
                {"input_ids": _tokens(), "attention_mask": mask}, _classes(), class_loss, [2, 2])


def t5() -> Case:
    """Encoder-decoder (T5) with decoder_input_ids."""
    t = _hf()
    cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                     num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
                     dropout_rate=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    return Case("t5", t.T5ForConditionalGeneration(cfg).eval(),
                {"input_ids": _tokens(), "decoder_input_ids": _tokens(5, 6)}, _tokens(11, 6),
                token_loss, [4, 4, 4])


def vit() -> Case:
    """Vision transformer (ViT, 8x8 patches of 32x32 images)."""
    t = _hf()
    cfg = t.ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      num_labels=CLASSES, attn_implementation="eager")
    torch.manual_seed(0)
    return Case("vit", t.ViTForImageClassification(cfg).eval(), {"pixel_values": _images()},
                _classes(), class_loss, [4, 4])


def swin() -> Case:
    """Windowed-attention vision model (Swin, two stages, window 4)."""
    t = _hf()
    cfg = t.SwinConfig(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16,
                       depths=[1, 1], num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       drop_path_rate=0.0, num_labels=CLASSES)
    torch.manual_seed(0)
    return Case("swin", t.SwinForImageClassification(cfg).eval(), {"pixel_values": _images()},
                _classes(), class_loss, [2, 4])


def convnext() -> Case:
    """ConvNeXt: depthwise convolutions, LayerNorm on channels-last views, layer scale."""
    t = _hf()
    cfg = t.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32],
                           depths=[1, 1], drop_path_rate=0.0, layer_scale_init_value=0.5,
                           num_labels=CLASSES)
    torch.manual_seed(0)
    return Case("convnext", t.ConvNextForImageClassification(cfg).eval(),
                {"pixel_values": _images()}, _classes(), class_loss, [])


# -- plain torch.nn ------------------------------------------------------------------------
class TransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` over token embeddings, mean-pooled, then a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


class LSTMClassifier(nn.Module):
    """Embedding, a 1-layer ``nn.LSTM``, the last step's hidden output, a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, ids):
        out, _ = self.lstm(self.embed(ids))
        return self.head(out[:, -1])


class MHAModel(nn.Module):
    """Linear in, ``nn.MultiheadAttention`` self-attention with a residual, LayerNorm, head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        h = self.proj(x)
        a, _ = self.attn(h, h, h)
        return self.head(self.norm(h + a).mean(1))


def transformer_encoder() -> Case:
    torch.manual_seed(0)
    return Case("nn_transformer", TransformerClassifier().eval(), (_tokens(),), _classes(),
                class_loss, [4, 4])


def lstm() -> Case:
    torch.manual_seed(0)
    return Case("nn_lstm", LSTMClassifier().eval(), (_tokens(),), _classes(), class_loss, [])


def mha() -> Case:
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, 16, generator=_gen(4))
    return Case("nn_mha", MHAModel().eval(), (x,), _classes(), class_loss, [4])


BUILDERS: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "llama": llama, "qwen2": qwen2, "gemma": gemma, "gpt_neox": gpt_neox,
    "qwen3": qwen3, "gemma3": gemma3, "olmo2": olmo2, "qwen3_moe": qwen3_moe,
    "bert": bert, "t5": t5, "vit": vit,
    "swin": swin, "convnext": convnext, "nn_transformer": transformer_encoder,
    "nn_lstm": lstm, "nn_mha": mha,
}
