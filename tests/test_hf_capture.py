"""Hugging Face models are captured with transformers.utils.fx (the pinned hf extra)."""
import pytest
import torch

import tidal

transformers = pytest.importorskip("transformers")


def test_hf_llama_compiles_and_matches_eager():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 8))
    compiled = tidal.compile(model, {"input_ids": ids})
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(input_ids=ids).logits)
    annotated = [r for r in compiled.records if r.name == "annotate"][0]
    assert "GFLOP" in annotated.notes[0]


def test_hf_bert_with_positional_inputs():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 100, (2, 6))
    compiled = tidal.compile(model, (ids,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(input_ids=ids).logits)
