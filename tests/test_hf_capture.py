"""Hugging Face models are captured through torch.export (non-strict), whatever the
transformers version: the compile report's trace row says so, and no code path imports
transformers.utils.fx."""
import sys

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
    assert "trace: traced with torch.export (non-strict)" in compiled.report()
    assert any("use_cache=False" in n for n in compiled.records[0].notes)


def test_hf_bert_with_positional_inputs():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 100, (2, 6))
    compiled = tidal.compile(model, (ids,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(input_ids=ids).logits)
        # the batch stays symbolic: another batch size runs the same graph
        more = torch.randint(0, 100, (5, 6))
        torch.testing.assert_close(compiled(more)["logits"], model(input_ids=more).logits)


def test_no_code_path_imports_transformers_utils_fx(monkeypatch):
    """Nothing this process imported so far (every tidal module the suite loaded before this
    test, or none) holds ``transformers.utils.fx``, and a compile with it unimportable (as if
    transformers had no utils.fx) works and equals eager. In this process, not a fresh one (a
    fresh Python was 10 s of the suite): a module-level import that ran before would have left
    the module in ``sys.modules``; one that runs during the compile raises."""
    assert "transformers.utils.fx" not in sys.modules
    monkeypatch.setitem(sys.modules, "transformers.utils.fx", None)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 32, (2, 5))
    c = tidal.compile(model, {"input_ids": ids})
    with torch.no_grad():
        torch.testing.assert_close(c(ids)["logits"], model(ids).logits)
