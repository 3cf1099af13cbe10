"""CHAI decoding and calibration run where the model's weights are (issue 31).

On the CPU, the ``meta`` device stands in for a GPU: like CUDA it refuses to mix its tensors
with CPU ones (``Tensor on device cpu is not on the expected device meta!``), and it runs every
shape-only path (no value read back), so a table or mask built on the CPU fails here as it
would on a GPU. The tests marked ``cuda`` compare the real thing with the CPU (``make
gpu-check``; skipped without a GPU)."""
import copy
import dataclasses

import pytest
import torch

from examples.models import llama_small
from tidal.ir.plans.chai import ChaiPlan, LayerChoice
from tidal.passes.chai_calibrate import HeadStats, kmeans_errors, nearest_centres
from tidal.runtime.chai import hf_compat
from tidal.runtime.chai.cache import ClusteredKCache
from tidal.runtime.chai.decode import ChaiDecoder

from test_chai_calibrate import grouped_points

META = torch.device("meta")


def _llama(seed: int = 0):
    torch.manual_seed(seed)  # the zoo model's weights come from the global generator
    return llama_small().eval()


def _static_plan(model, k: int = 2) -> ChaiPlan:
    """CHAI-static with ``k`` clusters per layer (membership fixed, so no value is read)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    labels = tuple(h % k for h in range(heads))
    return ChaiPlan(tuple(
        LayerChoice(i, f"model.layers.{i}.self_attn", heads, cfg.num_key_value_heads,
                    cfg.hidden_size // heads, k, k, (), labels, tuple(range(k)))
        for i in range(cfg.num_hidden_layers)), mode="static")


# --- ChaiDecoder ---

def test_decoder_builds_its_tables_on_the_weights_device():
    model = _llama().to(META)
    dec = ChaiDecoder(model)
    cos, sin = dec._rope(3, 4)
    assert dec.inv_freq.device == META
    assert cos.device == sin.device == META and cos.shape == (4, dec.head_dim)
    assert dec.device == META


@pytest.mark.parametrize("clustered", [False, True])
def test_decoder_generates_on_the_weights_device(clustered):
    """Prefill (rotary tables, the first tokens' causal mask), the clusters' index tensors and
    the decode steps all stay on the weights' device."""
    model = _llama().to(META)
    dec = ChaiDecoder(model, plan=_static_plan(model) if clustered else None)
    ids = torch.randint(0, 256, (2, 12)).to(META)
    out = dec.generate(ids, 3)
    assert out.device == META and out.shape == (2, 15)
    logits, state = dec.prefill(ids)
    assert logits.device == META and all(k.device == META for k in state.keys)
    for cl in state.clusters:
        assert (cl is not None) == clustered
        if cl is not None:
            assert {cl.kv_keep.device, cl.q_index.device, cl.slot_of_head.device} == {META}


def test_decoder_tables_follow_the_weights_dtype():
    model = _llama().double()
    dec = ChaiDecoder(model)
    assert dec._rope(0, 4)[0].dtype == torch.float64
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(dec.prefill(ids)[0], model(ids), rtol=1e-10, atol=1e-10)


def test_decoder_refuses_ids_and_weights_on_other_devices_by_name():
    dec = ChaiDecoder(_llama().to(META))
    with pytest.raises(ValueError, match="input_ids is on cpu but the model's weights are on meta"):
        dec.prefill(torch.randint(0, 256, (1, 12)))
    state = dec.new_state(1, 16)
    with pytest.raises(ValueError, match="token is on cpu"):
        dec.step(torch.zeros(1, 1, dtype=torch.long), state)
    split = _llama()
    split.lm_head.to(META)
    with pytest.raises(ValueError, match="embedding is on cpu, lm_head on meta"):
        ChaiDecoder(split)


# --- calibration ---

def test_nearest_centres_stays_on_the_points_device():
    x, centres = torch.randn(6, 3, device=META), torch.randn(2, 3, device=META)
    out = nearest_centres(x, centres)
    assert out.device == META and out.shape == (6,)


def test_kmeans_errors_are_todays_and_come_from_the_host():
    """The seeded k-means (draws from a CPU generator) gives the values it gave before it took
    points on any device; the points are read on the CPU whatever their device."""
    errors = kmeans_errors(grouped_points(3, noise=0.5, seed=3))
    assert errors == pytest.approx(
        (591.2973600031116, 136.30494577045923, 26.35123499425453, 19.28007374165821,
         13.83817385284706, 9.041906207648024, 5.938553353365243, 2.4093776997899212, 0.0),
        rel=1e-9)
    stats = HeadStats()
    probs = torch.rand(2, 6, 40, 40, generator=torch.Generator().manual_seed(0)).softmax(-1)
    stats.add(0, probs.requires_grad_())
    assert stats.errors(0) == pytest.approx(
        (0.3196394714398699, 0.2514537936252204, 0.1858213603108504, 0.12194983451470362,
         0.06063674990634771, 0.0), rel=1e-9)
    assert stats.similarity(0).device.type == "cpu"


# --- the cache of compiled.generate ---

def test_cache_placeholders_are_on_the_layers_device():
    """A layer's first K/V before an earlier layer's (and the empty view of a layer not yet
    reached) are made on the device of the K/V the cache holds."""
    plan = ChaiPlan(tuple(LayerChoice(i, f"l{i}", 4, 2, 8, None, 4) for i in range(3)))
    cache = ClusteredKCache(plan)
    q, k = torch.randn(1, 4, 7, 8, device=META), torch.randn(1, 2, 7, 8, device=META)
    assert cache.attend(1, q, k, k, None, 8 ** -0.5).device == META
    assert hf_compat.layer_kv(cache, 1)[0].device == META
    assert cache[0][0].device == META and cache[2][1].device == META


# --- on a GPU (make gpu-check) ---

def _same_logits_teacher_forced(cpu: ChaiDecoder, gpu: ChaiDecoder, ids, new: int):
    """The CPU decoder's greedy tokens fed to both; logits compared at every step."""
    tokens = cpu.generate(ids, new)
    logits, state = cpu.prefill(ids, tokens.shape[1])
    glogits, gstate = gpu.prefill(ids.cuda(), tokens.shape[1])
    torch.testing.assert_close(glogits.cpu(), logits, rtol=1e-4, atol=1e-4)
    assert cpu.memberships(state) == gpu.memberships(gstate)
    for t in range(ids.shape[1], tokens.shape[1] - 1):
        step = cpu.step(tokens[:, t:t + 1], state)
        gstep = gpu.step(tokens[:, t:t + 1].cuda(), gstate)
        torch.testing.assert_close(gstep.cpu(), step, rtol=1e-4, atol=1e-4)
    assert torch.equal(gpu.generate(ids.cuda(), new).cpu(), tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["unclustered", "online k=2", "static k=2"])
def test_cuda_decoder_equals_the_cpu_decoder(how):
    model = _llama()
    gpu_model = copy.deepcopy(model).cuda()
    kw = {"unclustered": {}, "online k=2": {"counts": 2},
          "static k=2": {"plan": _static_plan(model)}}[how]
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    cpu, gpu = ChaiDecoder(model, **kw), ChaiDecoder(gpu_model, **kw)
    assert gpu.inv_freq.device.type == "cuda"
    _same_logits_teacher_forced(cpu, gpu, ids, 6)


@pytest.mark.cuda
def test_cuda_kmeans_and_head_stats_equal_the_cpu():
    points = grouped_points(3, noise=0.5, seed=3)
    assert kmeans_errors(points.cuda()) == kmeans_errors(points)
    probs = torch.rand(2, 6, 40, 40, generator=torch.Generator().manual_seed(0)).softmax(-1)
    cpu, gpu = HeadStats(), HeadStats()
    cpu.add(0, probs)
    gpu.add(0, probs.cuda())
    assert gpu.errors(0) == cpu.errors(0)
    assert torch.equal(gpu.similarity(0), cpu.similarity(0))


@pytest.mark.cuda
def test_cuda_calibration_runs_and_plans_every_layer():
    from tidal.passes.chai_calibrate import Budget
    from tidal.passes.clustered_attention import calibrate

    model = _llama().cuda()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 24), generator=gen).cuda(),) for _ in range(4)]
    plan = calibrate(model, batches, budget=Budget(tolerance=0.03))
    assert len(plan.layers) == 2 and all(len(c.errors) == 4 for c in plan.layers)
    assert plan.final_metric <= plan.baseline_metric * 1.015 + 1e-9
    loose = calibrate(model, batches, budget=Budget(tolerance=10.0))
    assert loose.counts() == {0: 1, 1: 1}
    assert all(c.static_reps and len(c.static_labels) == 4 for c in loose.layers)
    # the decoder runs the plans on the GPU, CHAI-static included
    ids = batches[0][0][:1, :12]
    for p in (plan, loose, dataclasses.replace(loose, mode="static")):
        assert ChaiDecoder(model, plan=p).generate(ids, 4).shape == (1, 16)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "gpt2", "opt"])
def test_cuda_compiled_generate_is_hf_generate_at_one_head_per_cluster(name):
    from third_party.test_chai_generate import TOL, _compiled, _decoder, _gen, _ids

    model = _decoder(name).cuda()
    ids = _ids(2, 9).cuda()
    compiled = _compiled(model, ids, 8)
    ours, theirs = _gen(compiled, ids, do_sample=False), _gen(model, ids, do_sample=False)
    assert ours.sequences.device.type == "cuda"
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), **TOL)
    clustered = _compiled(model, ids, 2)
    cache = clustered.new_cache()
    out = _gen(clustered, ids, do_sample=False, past_key_values=cache)
    assert out.sequences.shape == (2, 15) and out.sequences.device.type == "cuda"
    assert cache.k_cache_bytes() < cache.v_cache_bytes()   # K kept for fewer heads than V
    assert all(k.device.type == "cuda" for k, _ in hf_compat.layers_kv(cache))


# --- the timing a GPU harness calls (benchmarks/chai_generate.py --tiny) ---

def _tiny_ttnt(device: str, **sizes) -> dict:
    from benchmarks.chai_generate import TINY_PATHS, tiny_ttnt

    result = tiny_ttnt(device, **sizes)
    assert result["equal"] and result["device"].startswith(device)
    assert all(result[f"{p}.ttnt_ms"] > 0 for p in TINY_PATHS)
    return result


def test_tiny_decode_timing_runs_with_no_weights():
    _tiny_ttnt("cpu", context=24, new_tokens=2, repeats=1)


@pytest.mark.cuda
def test_cuda_tiny_decode_timing():
    _tiny_ttnt("cuda", context=256, new_tokens=8, repeats=1)
