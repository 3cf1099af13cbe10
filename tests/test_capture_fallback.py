"""A Hugging Face model that ``transformers.utils.fx`` does not list (MobileViT) is traced with
its tracer anyway, keeping whole only the modules whose forward cannot be traced; the report
says which. A top-level ``torch.nn`` module fx cannot trace is kept whole."""
import torch
import transformers

import tidal
from tidal.ir import meta


def _mobilevit():
    cfg = transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 16, 16],
                                       neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
                                       num_attention_heads=2, num_labels=3)
    torch.manual_seed(0)
    return transformers.MobileViTForImageClassification(cfg).eval()


def test_mobilevit_is_traced_with_failing_modules_kept_whole():
    # not on transformers.utils.fx's list; its tracer fails inside MobileViTLayer (int() of a
    # traced size), so that class is kept whole and the rest traced (the torch.fx fallback, for
    # graphs HF's tracer cannot make, is tested in tests/third_party/test_unlisted_hf.py)
    model = _mobilevit()
    x = torch.randn(2, 3, 32, 32)
    c = tidal.compile(model, {"pixel_values": x}, passes=["layer_groups"])
    with torch.no_grad():
        torch.testing.assert_close(c(pixel_values=x)["logits"], model(pixel_values=x).logits,
                                   rtol=1e-5, atol=1e-5)
    notes = meta.get_trace_notes(c.graph_module) or c.records[0].notes
    assert "traced with its tracer anyway" in notes[0], notes
    assert "MobileViTLayer (first: mobilevit.encoder.layer.2)" in notes[0]
    assert "supported models" not in notes[0]
    leaves = {n.target for n in c.graph_module.graph.nodes if n.op == "call_module"}
    assert "mobilevit.encoder.layer.2" in leaves          # kept whole
    assert "mobilevit.conv_stem.convolution" in leaves     # the rest is traced through
    assert "trace: transformers.utils.fx does not list" in c.report()


def test_a_torch_nn_model_fx_cannot_trace_is_kept_whole():
    # nn.TransformerEncoder's own forward checks src.is_nested (fx cannot trace it): compiled
    # at top level, it becomes one node, with a note saying so, and computes what it did
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
        16, 2, 32, batch_first=True, dropout=0.0), 2).eval()
    x = torch.randn(4, 5, 16)
    c = tidal.compile(enc, (x,))
    with torch.no_grad():
        torch.testing.assert_close(c(x), enc(x))
    assert "TransformerEncoder" in c.records[0].notes[0] and "kept whole" in c.records[0].notes[0]
    assert [n.op for n in c.graph_module.graph.nodes].count("call_module") == 1


def test_tracing_a_training_model_leaves_its_buffers_as_they_were():
    # HF's tracer runs BatchNorm's num_batches_tracked += 1 for real, and checking the graph
    # of an unlisted model against eager runs every BatchNorm twice in training mode
    model = _mobilevit().train()
    before = {k: v.clone() for k, v in model.named_buffers()}
    tidal.compile(model, {"pixel_values": torch.randn(2, 3, 32, 32)})
    changed = [k for k, v in model.named_buffers() if not torch.equal(v, before[k])]
    assert not changed, changed
