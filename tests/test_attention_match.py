"""The attention matcher finds every layer of the zoo LM and BERT, HF Llama and GPT-2 (eager),
nn.MultiheadAttention (standalone and inside torch's transformer layers) and SDPA calls, with
their head counts."""
import pytest
import torch

import tidal
from tidal.ir.cost import annotate
from tidal.passes.attention_match import (LOOKED_FOR, NoAttentionFound, find_attention,
                                          hidden_attention, require_attention)
from examples.models import bert_small, llama_small

transformers = pytest.importorskip("transformers")


def hf_llama(layers=3):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def hf_gpt2(layers=3):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=100,
                                  n_positions=64, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


class MHA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.b = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.b(*(self.a(x, x, x)[0],) * 3)[0]


def causal_mask(t):
    """A boolean causal mask of ``t`` positions (True: masked), traceable with a proxy ``t``."""
    return torch.nn.Transformer.generate_square_subsequent_mask(t).isinf()


class TorchEncoder(torch.nn.Module):
    """A 2-layer ``nn.TransformerEncoder`` (d_model 16, 4 heads) on batch-first inputs ``x``
    ``[B, T, 16]`` with an optional key padding mask ``pad`` ``[B, T]``; ``batch_first=False``
    layers get ``x`` transposed (tidal's batch is dim 0 of the inputs); ``causal`` adds a
    causal mask."""

    def __init__(self, batch_first=True, norm_first=False, causal=False, nested=False):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first,
                                                 norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.batch_first, self.causal = batch_first, causal

    def forward(self, x, pad=None):
        mask = causal_mask(x.shape[1]) if self.causal else None
        if self.batch_first:
            return self.encoder(x, mask=mask, src_key_padding_mask=pad)
        out = self.encoder(x.transpose(0, 1), mask=mask, src_key_padding_mask=pad)
        return out.transpose(0, 1)


class TorchDecoderLayer(torch.nn.Module):
    """One ``nn.TransformerDecoderLayer`` (d_model 16, 4 heads): causal self-attention on ``x``,
    cross-attention to ``memory``."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)

    def forward(self, x, memory):
        return self.layer(x, memory, tgt_mask=causal_mask(x.shape[1]))


class SDPA(torch.nn.Module):
    """Grouped-query SDPA: 4 query heads, 2 KV heads of size 4."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).unflatten(-1, (4, 4)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2, 2, 4)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)


def test_zoo_llama_every_layer_with_gqa():
    model = llama_small()
    found = find_attention(tidal.trace(model, model.example_inputs(1)), model)
    assert [m.scope for m in found] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert {(m.kind, m.num_heads, m.num_kv_heads, m.head_dim) for m in found} == {("eager", 4, 2, 16)}
    assert found[1].q_proj == "model.layers.1.self_attn.q_proj"
    assert found[1].v_proj == "model.layers.1.self_attn.v_proj"


def test_zoo_bert_every_layer():
    model = bert_small()
    found = find_attention(tidal.trace(model, model.example_inputs(1)), model)
    assert len(found) == model.config.num_hidden_layers
    assert all((m.num_heads, m.num_kv_heads, m.head_dim) == (4, 4, 16) for m in found)
    assert found[0].k_proj.endswith("attention.self.key")


def test_hf_llama_every_layer():
    model = hf_llama()
    found = find_attention(tidal.trace(model, {"input_ids": torch.randint(0, 128, (1, 8))}), model)
    assert [m.scope for m in found] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert all((m.num_heads, m.num_kv_heads, m.head_dim) == (4, 2, 8) for m in found)


def test_hf_gpt2_every_layer_fused_projection():
    model = hf_gpt2()
    found = find_attention(tidal.trace(model, {"input_ids": torch.randint(0, 100, (1, 8))}), model)
    assert [m.scope for m in found] == [f"transformer.h.{i}.attn" for i in range(3)]
    assert all(m.q_proj == m.k_proj == m.v_proj == f"transformer.h.{m.index}.attn.c_attn"
               for m in found)
    assert all((m.num_heads, m.num_kv_heads, m.head_dim) == (4, 4, 8) for m in found)


def test_multihead_attention_modules():
    found = find_attention(tidal.trace(MHA(), (torch.randn(1, 6, 16),)))
    assert [(m.kind, m.scope, m.num_heads, m.head_dim) for m in found] == \
        [("module", "a", 4, 4), ("module", "b", 2, 8)]


def test_self_attention_inside_torch_transformer_layers():
    """fx keeps nn.TransformerEncoder whole (one call_module): its layers' self_attn are found
    inside it; a decoder layer's cross-attention is listed as left alone."""
    x, pad = torch.randn(2, 9, 16), torch.zeros(2, 9, dtype=torch.bool)
    gm = tidal.trace(TorchEncoder(), (x, pad))
    found = find_attention(gm)
    assert [(m.kind, m.node, m.scope, m.num_heads, m.head_dim) for m in found] == \
        [("module", "encoder", f"encoder.layers.{i}.self_attn", 4, 4) for i in range(2)]
    assert hidden_attention(gm, found) == []
    gm = tidal.trace(TorchDecoderLayer(), (x, torch.randn(2, 7, 16)))
    found = find_attention(gm)
    assert [(m.node, m.scope) for m in found] == [("layer", "layer.self_attn")]
    assert hidden_attention(gm, found) == ["layer.multihead_attn"]


def test_sdpa_call_with_shapes_from_annotation():
    x = (torch.randn(1, 6, 16),)
    gm = tidal.trace(SDPA(), x)
    annotate(gm, x)
    (m,) = find_attention(gm)
    assert (m.kind, m.num_heads, m.num_kv_heads, m.head_dim, m.q_proj, m.k_proj) == \
        ("sdpa", 4, 2, 4, "q", "kv")


def test_no_attention_lists_what_was_looked_for():
    gm = tidal.trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1)),
                     (torch.randn(2, 4),))
    assert find_attention(gm) == []
    with pytest.raises(NoAttentionFound) as err:
        require_attention(gm)
    assert all(item in str(err.value) for item in LOOKED_FOR)
