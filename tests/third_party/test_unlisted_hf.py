"""Hugging Face models that ``transformers.utils.fx`` never listed as supported (Gemma, whose
graph its tracer made with the check off; Gemma-2, whose decoder layers it could not trace;
CodeGen, whose traced graph failed to run; GPT-Neo) are captured whole through torch.export,
like every Hugging Face model.
Reference: the eager model on the same inputs (tolerance 1e-5; the same kernels run)."""
import pytest
import torch

import tidal

transformers = pytest.importorskip("transformers")

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=8,
             max_position_embeddings=128)


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def _check(model, note: str) -> None:
    ids = _ids()
    compiled = tidal.compile(model, {"input_ids": ids})
    (trace,) = [r for r in compiled.records if r.name == "trace"]
    assert any(note in n for n in trace.notes), trace.notes
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "codegen"])
def test_a_model_the_hf_tracer_could_not_take_is_captured_through_export(name):
    torch.manual_seed(0)
    if name == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL))
    elif name == "gemma2":   # its decoder layers branch on a mask shape
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL))
    else:                    # its graph from HF's tracer failed when run
        model = transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=128, rotary_dim=4))
    _check(model.eval(), "traced with torch.export (non-strict)")


def test_a_device_read_in_the_graph_does_not_reach_the_meta_device():
    # GPT-Neo moves a tensor to another's .device; the cost model's meta run read the meta
    # device there and its CPU rerun failed with "Cannot copy out of meta tensor"
    torch.manual_seed(0)
    model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=8,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=128)).eval()
    ids = _ids()
    compiled = tidal.compile(model, (ids,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(ids).logits,
                                   rtol=1e-5, atol=1e-5)
