"""Capture: fx forward graphs, whole training steps with make_fx, and TraceError."""
import copy

import pytest
import torch

import tidal
from examples.models import ZOO
from tidal.ir.capture import capture_train_step, trace


def _eager_grads(model, inputs, targets):
    model.zero_grad()
    loss = model.default_loss(model(*inputs), targets)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _check_train_step(model, inputs, targets):
    model.train()
    reference = copy.deepcopy(model)
    step = capture_train_step(model, inputs, targets, model.default_loss)
    loss, grads = step.run(model, inputs, targets)
    ref_loss, ref_grads = _eager_grads(reference, inputs, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=k)
    # BatchNorm running statistics were updated in place exactly as in eager training
    for (k, b), rb in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-6, msg=k)
    return step


@pytest.mark.slow
def test_train_step_capture_resnet50():
    torch.manual_seed(0)
    model = ZOO["resnet50"]()
    x, y = (torch.randn(2, 3, 64, 64),), torch.tensor([3, 7])
    step = _check_train_step(model, x, y)
    assert len(step.buffer_names) > 0  # BatchNorm buffers are graph inputs
    targets = {str(n.target) for n in step.gm.graph.nodes if n.op == "call_function"}
    assert any("convolution_backward" in t for t in targets)


def test_train_step_capture_small_models():
    for name in ("resnet50_small", "llama_small", "bert_small"):
        model = ZOO[name]()
        _check_train_step(model, model.example_inputs(2), model.example_targets(2))


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow
            return y
        return -y


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.body = torch.nn.Sequential(torch.nn.ReLU(), _DataDependent())

    def forward(self, x):
        return self.body(self.stem(x))


def test_trace_error_names_module_line_and_leaf_option():
    with pytest.raises(tidal.TraceError) as info:
        tidal.compile(_Outer(), torch.randn(2, 4))
    err = info.value
    assert err.module_path == "body.1" and err.module_type == "_DataDependent"
    assert err.location.endswith(f"test_capture.py:{_DataDependent.forward.__code__.co_firstlineno + 2}")
    assert "if y.sum() > 0" in str(err) and "leaf_modules" in str(err)


def test_leaf_module_option_makes_it_traceable():
    model, x = _Outer(), torch.randn(2, 4)
    for leaf in ("body.1", _DataDependent):
        compiled = tidal.compile(model, x, leaf_modules=[leaf])
        torch.testing.assert_close(compiled(x), model(x))
        assert "body.1" in {str(n.target) for n in compiled.graph_module.graph.nodes}


def test_defaults_are_pinned_for_optional_forward_args():
    model = ZOO["llama_small"]().eval()
    (ids,) = model.example_inputs(2)
    gm = trace(model, (ids,))
    torch.testing.assert_close(gm(ids), model(ids))


def test_trace_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        trace(lambda x: x, (torch.randn(1),))
