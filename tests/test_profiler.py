"""profile_layers: measured per-node times on the CPU, the on-disk cache, progress output."""
from __future__ import annotations

import time

import pytest
import torch
import torch.fx as fx
from torch import nn

from tidal.ir import cost, profiler
from tidal.ir.device_profile import DeviceProfile
from tidal.ir.node_runner import COMPUTE_OPS
from tidal.ir.profiler import default_cache_dir, node_signature, profile_layers

FAST = dict(repeats=3, warmup=1, progress=False)


@pytest.fixture(autouse=True)
def one_thread():
    """Single-threaded kernels keep CPU timings stable on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp() -> fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8), nn.ReLU(),
                          nn.Linear(8, 8))
    return fx.symbolic_trace(model)


def _compute_nodes(gm):
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def test_every_node_measured_at_every_batch(tmp_path):
    gm = _mlp()
    prof = profile_layers(gm, (torch.randn(4, 512),), [2, 16], cache_dir=tmp_path, **FAST)
    assert isinstance(prof, DeviceProfile) and prof.name.startswith("measured:cpu")
    for n in _compute_nodes(gm):
        for b in (2, 16):
            t = prof.lookup(node_signature(gm, n, b))
            assert t is not None, (n.name, b)
            assert t.fwd_us > 0 and t.bwd_us > 0
    assert len(prof) == 2 * len(_compute_nodes(gm))


def test_bigger_layer_is_slower(tmp_path):
    gm = _mlp()
    prof = profile_layers(gm, (torch.randn(4, 512),), [64], cache_dir=tmp_path, **FAST)
    big, _, _, _, small = _compute_nodes(gm)
    assert gm.get_submodule(big.target).in_features == 512
    assert gm.get_submodule(small.target).in_features == 8
    assert prof.lookup(node_signature(gm, big, 64)).total_us > (
        prof.lookup(node_signature(gm, small, 64)).total_us)


def test_cache_round_trip_measures_nothing_the_second_time(tmp_path, monkeypatch):
    calls = []
    real = profiler.run_isolated

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "run_isolated", counting)
    gm, x = _mlp(), (torch.randn(4, 512),)
    first = profile_layers(gm, x, [2, 4], cache_dir=tmp_path, **FAST)
    assert calls and len(list(tmp_path.glob("profile-*.json"))) == 1
    calls.clear()
    second = profile_layers(_mlp(), x, [4, 2], cache_dir=tmp_path, **FAST)
    assert calls == [] and second == first
    third = profile_layers(gm, x, [3], cache_dir=tmp_path, **FAST)
    assert calls and len(list(tmp_path.glob("profile-*.json"))) == 2
    assert node_signature(gm, _compute_nodes(gm)[0], 3) in third


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TIDAL_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "tidal", "profiles")


def test_progress_bar_only_when_asked(tmp_path, capsys):
    gm, x = _mlp(), (torch.randn(2, 512),)
    profile_layers(gm, x, [2], cache_dir=tmp_path / "a", repeats=1, warmup=0, progress=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    profile_layers(gm, x, [2], cache_dir=tmp_path / "b", repeats=1, warmup=0, progress=True)
    assert "profiling layers" in capsys.readouterr().err


class _TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, ids):
        return self.norm(self.emb(ids).mean(dim=1)).sum(dim=-1)


def test_token_ids_stay_valid_and_model_untouched(tmp_path):
    model = _TokenModel()
    gm = fx.symbolic_trace(model)
    ids = torch.randint(0, 10, (3, 5))
    ids[0, 0] = 9
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    prof = profile_layers(gm, (ids,), [8, 32], cache_dir=tmp_path, **FAST)
    assert all(node_signature(gm, n, b) in prof for n in _compute_nodes(gm) for b in (8, 32))
    assert all(torch.equal(v, before[k]) for k, v in gm.state_dict().items())
    mean = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "mean")
    assert node_signature(gm, mean, 32) == "Tensor.mean | (T){dim=1} | B=32 | float32[32,5,4]"
    emb = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "emb")
    assert node_signature(gm, emb, 8).endswith("| B=8 | int64[8,5]")


def test_node_signature_needs_annotation_and_compute_node():
    gm = _mlp()
    lin = _compute_nodes(gm)[0]
    with pytest.raises(ValueError, match="annotate"):
        node_signature(gm, lin, 2)
    cost.annotate(gm, (torch.randn(4, 512),))
    placeholder = next(iter(gm.graph.nodes))
    with pytest.raises(ValueError, match="not a compute op"):
        node_signature(gm, placeholder, 2)
    assert node_signature(gm, lin, 7).endswith("| (T) | B=7 | float32[7,512]")


def test_bad_arguments_are_named(tmp_path):
    gm, x = _mlp(), (torch.randn(2, 512),)
    with pytest.raises(ValueError, match="batch_sizes"):
        profile_layers(gm, x, [0], cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="repeats"):
        profile_layers(gm, x, [2], repeats=0, cache_dir=tmp_path, progress=False)


def test_calibrate_profile_scales_one_batch_to_a_whole_step_measurement(tmp_path):
    from tidal.ir.profiler import calibrate_profile, node_signatures, time_training_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    gm = torch.fx.symbolic_trace(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    prof = profile_layers(gm, (x,), [4, 8], repeats=2, warmup=1, cache_dir=tmp_path,
                          progress=False)
    before = [p.detach().clone() for p in gm.parameters()]
    step = time_training_step(gm, (x,), y, torch.nn.functional.cross_entropy, repeats=2,
                              stat="min")
    assert step.fwd_bwd_us > 0 and step.update_us > 0
    assert all(torch.equal(a, b) for a, b in zip(before, gm.parameters()))  # gm untouched
    cal = calibrate_profile(prof, gm, 8, 1000.0)
    at8 = list(node_signatures(gm, 8).values())
    assert sum(cal.lookup(s).total_us for s in at8) == pytest.approx(1000.0)
    ratio = {cal.lookup(s).fwd_us / prof.lookup(s).fwd_us for s in at8}
    assert max(ratio) == pytest.approx(min(ratio))  # one factor for the whole batch
    for s in node_signatures(gm, 4).values():  # other batches untouched
        assert cal.lookup(s) == prof.lookup(s)
    with pytest.raises(ValueError, match="total_us"):
        calibrate_profile(prof, gm, 8, 0.0)
    with pytest.raises(ValueError, match="no entry"):
        calibrate_profile(prof, gm, 3, 10.0)
    with pytest.raises(ValueError, match="stat"):
        time_training_step(gm, (x,), y, torch.nn.functional.cross_entropy, stat="mean")


def test_training_step_samples_calls_before_each_outside_the_timing():
    from tidal.ir.profiler import training_step_samples

    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
    calls = []
    fb, up = training_step_samples(gm, (x,), y, torch.nn.functional.cross_entropy, repeats=3,
                                   warmup=1, before_each=lambda: calls.append(time.sleep(0.05)))
    assert len(calls) == 4 and len(fb) == len(up) == 3
    assert all(0 < t < 50_000 for t in fb)        # the 50 ms sleeps are not in the samples
    with pytest.raises(ValueError, match="repeats"):
        training_step_samples(gm, (x,), y, torch.nn.functional.cross_entropy, repeats=0)
