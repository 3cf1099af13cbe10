"""Capture paths besides plain torch.fx: a Hugging Face model that transformers.utils.fx never
listed (MobileViT) is captured whole through torch.export; a model torch.fx rejects (Python
on a traced size) goes through torch.export with a note saying why; a top-level ``torch.nn``
module fx cannot trace is kept whole; a model nothing can capture is a TraceError naming the
module and line; capturing leaves the model's buffers as they were, and the graph updates
them in place as eager does."""
import pytest
import torch

import tidal
from test_capture import _DataDependent
from test_export_capture import _Counter as _InPlaceCounter
from tidal.ir import meta

transformers = pytest.importorskip("transformers")


def _mobilevit():
    cfg = transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 16, 16],
                                       neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
                                       num_attention_heads=2, num_labels=3)
    torch.manual_seed(0)
    return transformers.MobileViTForImageClassification(cfg).eval()


def test_mobilevit_is_captured_through_export():
    # transformers.utils.fx's tracer failed inside MobileViTLayer (int() of a traced size),
    # which was kept whole; the export takes the whole model
    model = _mobilevit()
    x = torch.randn(2, 3, 32, 32)
    c = tidal.compile(model, {"pixel_values": x}, passes=["layer_groups"])
    with torch.no_grad():
        torch.testing.assert_close(c(pixel_values=x)["logits"], model(pixel_values=x).logits,
                                   rtol=1e-5, atol=1e-5)
    notes = meta.get_trace_notes(c.graph_module) or c.records[0].notes
    assert notes[0] == "traced with torch.export (non-strict)", notes
    leaves = {n.target for n in c.graph_module.graph.nodes if n.op == "call_module"}
    assert "mobilevit.encoder.layer.2" not in leaves          # traced through
    assert "mobilevit.conv_stem.convolution" in leaves
    assert "trace: traced with torch.export (non-strict)" in c.report()


class _SizeBranch(torch.nn.Module):
    """Python on a traced size: torch.fx cannot trace it, torch.export specialises it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] > 3:
            return self.lin(x)
        return -x


def test_a_model_fx_rejects_goes_through_export():
    model, x = _SizeBranch(), torch.randn(3, 4)
    c = tidal.compile(model, (x,))
    torch.testing.assert_close(c(x), model(x))
    (note,) = c.records[0].notes
    assert note.startswith("torch.fx cannot trace _SizeBranch") and \
        "traced with torch.export (non-strict) instead" in note, note
    assert [n.target for n in c.graph_module.graph.nodes if n.op == "call_module"] == ["lin"]


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.ReLU(), _DataDependent())

    def forward(self, x):
        return self.body(x)


def test_a_model_nothing_can_capture_names_the_module_and_line():
    with pytest.raises(tidal.TraceError) as info:
        tidal.compile(_Outer(), torch.randn(2, 4))
    err = info.value
    line = _DataDependent.forward.__code__.co_firstlineno + 2
    assert err.module_path == "body.1" and err.location.endswith(f"test_capture.py:{line}")
    assert "torch.export (non-strict)" in str(err) and "if y.sum() > 0" in str(err)


def test_export_errors_name_the_module_and_line():
    from tidal.ir.export_capture import export_trace

    with pytest.raises(tidal.TraceError) as info:
        export_trace(_Outer(), (torch.randn(2, 4),))
    line = _DataDependent.forward.__code__.co_firstlineno + 2
    assert info.value.module_path == "body.1" and info.value.module_type == "_DataDependent"
    assert info.value.location.endswith(f"test_capture.py:{line}")


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
    model = _mobilevit().train()
    before = {k: v.clone() for k, v in model.named_buffers()}
    tidal.compile(model, {"pixel_values": torch.randn(2, 3, 32, 32)})
    changed = [k for k, v in model.named_buffers() if not torch.equal(v, before[k])]
    assert not changed, changed


class _Counter(_InPlaceCounter):
    """A buffer updated in place by the forward, beside BatchNorm's own statistics; a Python
    branch on a size sends it through the export."""

    def forward(self, x):
        self.count.add_(1)
        y = self.bn(self.lin(x))
        return y * 2 if x.shape[0] > 1 else y


def test_in_place_buffer_updates_keep_eager_semantics():
    model, ref = _Counter().train(), _Counter().train()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    c = tidal.compile(model, (x,))
    assert float(model.count) == 0 and int(model.bn.num_batches_tracked) == 0  # trace: untouched
    assert "traced with torch.export" in c.records[0].notes[0]
    for _ in range(2):
        torch.testing.assert_close(c(x), ref(x))
    assert float(model.count) == 2 and int(model.bn.num_batches_tracked) == 2
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    assert c.graph_module.get_buffer("count") is model.count


class _Caching(torch.nn.Module):
    """A forward that keeps a tensor on its module (the export's is a fake tensor)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.last = self.lin(x)
        return self.last * 2 if x.shape[0] > 1 else self.last


def test_what_the_export_stores_on_the_model_is_undone():
    model, x = _Caching(), torch.randn(3, 4)
    c = tidal.compile(model, (x,))
    assert "last" not in vars(model)
    torch.testing.assert_close(c(x), model(x))
