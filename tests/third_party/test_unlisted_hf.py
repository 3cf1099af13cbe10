"""Hugging Face models that ``transformers.utils.fx`` does not list as supported.

Its check refuses them before tracing, though its tracer handles most of them: tidal traces
them with the check off, keeping whole the classes of modules it cannot trace (Gemma-2's
decoder layers), and keeps the graph only if it equals eager on the example inputs (Gemma);
otherwise it falls back to ``torch.fx``, keeping whole the modules it cannot trace (CodeGen's
decoder), whose outputs are ``ModelOutput`` objects that the graph then indexes.
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
    ids = _ids()  # keyword inputs: the torch.fx fallback's graph also has HF's **loss_kwargs
    compiled = tidal.compile(model, {"input_ids": ids})
    (trace,) = [r for r in compiled.records if r.name == "trace"]
    assert any(note in n for n in trace.notes), trace.notes
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)["logits"], model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_an_unlisted_model_is_traced_by_the_hf_tracer_and_checked():
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL)).eval()
    _check(model, "does not list GemmaForCausalLM as supported; traced with its tracer anyway")


def test_modules_the_hf_tracer_cannot_trace_are_kept_whole_by_class():
    # Gemma-2's decoder layers branch on a traced mask shape: every Gemma2DecoderLayer is kept
    # whole (one trace failure, not one per layer), the rest of the model is traced
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL)).eval()
    arange, cache_cls = torch.arange, transformers.models.gemma2.modeling_gemma2.Cache
    _check(model, "keeping whole the modules whose forward it cannot trace: Gemma2DecoderLayer "
                  "(first: model.layers.0), and the graph equals the model")
    # HF's tracer failed half-way through Gemma-2: what it patched for tracing is restored
    assert torch.arange is arange
    assert transformers.models.gemma2.modeling_gemma2.Cache is cache_cls


def test_a_decoder_kept_whole_returns_a_model_output_the_graph_can_index():
    # CodeGen's HF-traced graph fails when run, so torch.fx keeps its CodeGenModel whole and the
    # graph reads outputs[0] of it: cost annotation used to turn that ModelOutput into a plain
    # dict and fail with a bare "RuntimeError: 0"
    torch.manual_seed(0)
    model = transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=128, rotary_dim=4)).eval()
    _check(model, "keeping whole the modules whose forward cannot be traced: transformer "
                  "(CodeGenModel)")


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
