"""Memory timeline: predicted saved-for-backward bytes match saved_tensors_hooks within 10 %;
liveness, forward time and interleaving behave as the analysis says."""
import pytest
import torch

from examples.models import ZOO
from tidal.ir.capture import capture_train_step
from tidal.ir.memory_timeline import (interleave, measure_saved_bytes, memory_timeline,
                                      timeline_svg)

MODELS = ["vgg16_small", "resnet50_small", "bert_small", "llama_small"]


@pytest.mark.parametrize("name", MODELS)
def test_predicted_saved_bytes_within_10_percent_of_measured(name):
    torch.manual_seed(0)
    model = ZOO[name]().train()
    x, y = model.example_inputs(4), model.example_targets(4)
    tl = memory_timeline(capture_train_step(model, x, y, model.default_loss))
    measured = measure_saved_bytes(model, x, y, model.default_loss)
    assert measured > 0
    assert abs(tl.saved_bytes - measured) <= 0.10 * measured, (tl.saved_bytes, measured)
    assert tl.peak_bytes >= tl.saved_bytes
    assert 0 < tl.forward_us < tl.iteration_us


def _mlp_timeline(batch):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(batch, 32), torch.zeros(batch, dtype=torch.long)
    return memory_timeline(capture_train_step(m, (x,), y, torch.nn.functional.cross_entropy))


def test_liveness_peaks_at_the_end_of_forward_and_scales_with_batch():
    small, big = _mlp_timeline(8), _mlp_timeline(32)
    # the curve rises through the forward and falls back in the backward (Figure 1a)
    k = small.forward_nodes - 1
    assert small.live_bytes[k] >= small.saved_bytes
    assert small.live_bytes[-1] < small.live_bytes[k]
    assert big.saved_bytes > 3 * small.saved_bytes
    # hand count for batch 8 (float32): input 8x32, relu output 8x64, log_softmax 8x4,
    # int64 target 8, total_weight scalar; the addmm output dies at relu
    assert small.saved_bytes == 4 * (8 * 32 + 8 * 64 + 8 * 4) + 8 * 8 + 4


def test_interleaving_with_forward_offset_lowers_the_peak():
    tl = _mlp_timeline(64)
    il = interleave(tl, tl.forward_us)
    assert il.peak_sum <= il.peak_gang
    together = interleave(tl, 0.0)
    assert together.peak_sum == together.peak_gang
    svg = timeline_svg(il)
    assert svg.startswith("<svg") and "tock" in svg and svg.count("<polyline") == 3
    with pytest.raises(ValueError, match="samples=1"):
        interleave(tl, 0.0, samples=1)
