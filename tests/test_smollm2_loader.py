"""The SmolLM2 loader's conversion (runtime/chai/smollm2.py) on a tiny model: transformers 5 marks a
model loaded from GGUF as quantized and refuses to save it; the loader saves the dequantised
weights all the same (`make bench-chai` failed on transformers 5 without this)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_a_gguf_marked_model_saves_its_weights(tmp_path):
    from transformers.utils.quantization_config import GgufConfig

    from tidal.runtime.chai.smollm2 import _unquantized

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config.quantization_config = GgufConfig()
    plain = _unquantized(model)
    assert getattr(plain.config, "quantization_config", None) is None
    plain.save_pretrained(tmp_path, safe_serialization=True)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)
    assert back.lm_head.weight is back.model.embed_tokens.weight
