"""CHAI on the decoders Hugging Face ships (issue 20, item 4): ``clustered_attention`` finds
the attention of Llama, Qwen2, Mistral, GPT-2 and OPT by the graph pattern (not by model name),
eager and sdpa (OPT's eager attention: ``bmm`` on ``[B*H, T, D]`` with the scaling folded into
Q), every layer computes the rows after the first five through ``tidal::clustered_attention``,
and with one head per cluster the logits are the model's."""
import pytest
import torch

import tidal
from tidal.passes.clustered_attention import ClusteredAttention

from test_chai_eager_op import OpCalls

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _decoder(name: str, impl: str):
    t = transformers
    if name in ("llama", "qwen2", "mistral"):
        config_cls, model_cls = {"llama": (t.LlamaConfig, t.LlamaForCausalLM),
                                 "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
                                 "mistral": (t.MistralConfig, t.MistralForCausalLM)}[name]
        return model_cls(config_cls(**SMALL, attn_implementation=impl))
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                              n_positions=64, attn_implementation=impl))
    return t.OPTForCausalLM(t.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, word_embed_proj_dim=64,
                                        attn_implementation=impl))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "opt"])
def test_every_attention_layer_is_found_and_one_head_per_cluster_is_exact(name, impl):
    torch.manual_seed(0)
    model = _decoder(name, impl).eval()
    ids = torch.randint(0, 128, (2, 12))
    compiled = tidal.compile(model, (ids,), passes=[ClusteredAttention(clusters=4)])
    plan = compiled.plan.get("clustered_attention")
    assert plan is not None and len(plan.layers) == 2, compiled.report()
    (record,) = [r for r in compiled.records if r.name == "clustered_attention"]
    assert len(record.notes) == 1, record.notes     # no layer left sharing after the softmax
    with torch.no_grad():
        want = model(ids).logits
        with OpCalls() as calls:
            out = compiled(ids)
    assert calls.count == 2     # one per layer: the rows after the first five
    got = out.logits if hasattr(out, "logits") else out["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
