"""Compressors: decoded results against numpy references on 1, 2 and 4 gloo ranks; compression
effectively off equals all-reduce; error feedback keeps the residual; checkpoints continue bit for
bit (loaded with ``weights_only=True``); bf16/fp16 gradients are compressed in float32; bad input
is a clear ValueError."""
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from background_jobs import Job, sized_job

from tidal.runtime.comm.compressors import (COMPRESSORS, QSGD, Comm, PowerSGD, RandomK, SignSGD, TopK,
                                       make_compressor, pack_bits, seeded_generator, synchronize,
                                       unpack_bits)

SHAPES = {"conv": (6, 3, 2, 2), "fc": (8, 5), "bias": (7,)}


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _all_grads(size, step):
    return [{k: v.numpy().astype(np.float64) for k, v in _grads(r, step).items()}
            for r in range(size)]


def _make(spec):
    opts = {"min_compression_rate": 0} if spec.startswith("powersgd") else {}
    if spec == "signsgd-ef" or spec == "qsgd-ef":
        return make_compressor(spec[:-3] + (":3" if spec.startswith("qsgd") else ""),
                               error_feedback=True)
    return make_compressor(spec, **opts)


# ---- numpy references (one step, from every rank's matrix M_i) ---------------------------------

def _ref_powersgd(ms, q0):
    """P = sum M_i Q; P^ = orth(P); out = P^ (sum M_i^T P^)^T / N; residual_i = M_i - P^ P^T M_i."""
    p_hat, _ = np.linalg.qr(sum(m @ q0 for m in ms))
    out = p_hat @ sum(m.T @ p_hat for m in ms).T / len(ms)
    return out, [m - p_hat @ p_hat.T @ m for m in ms], sum(m.T @ p_hat for m in ms) / len(ms)


def _ref_topk(vs, k):
    out = np.zeros_like(vs[0])
    for v in vs:
        idx = np.argsort(-np.abs(v), kind="stable")[:k]
        out[idx] += v[idx]
    return out / len(vs)


def _ref_sign(vs):
    votes = sum(np.where(v >= 0, 1.0, -1.0) for v in vs)
    return np.sign(votes)


def _ref_qsgd(vs, us, s):
    total = np.zeros_like(vs[0])
    for v, u in zip(vs, us):
        norm = np.linalg.norm(v)
        r = np.abs(v) / norm * s
        low = np.floor(r)
        xi = low + (u < r - low)
        total += norm * np.sign(v) * xi / s
    return total / len(vs)


def _check_references(rank, size):
    world_grads = _all_grads(size, 0)
    mine = _grads(rank, 0)
    comm = Comm()
    # PowerSGD rank 2 (every matrix compressed), one step, error feedback.
    c = PowerSGD(2, min_compression_rate=0)
    out = synchronize(c, mine, comm)
    for key, shape in SHAPES.items():
        if len(shape) == 1:
            ref = sum(g[key] for g in world_grads) / size
            np.testing.assert_allclose(out[key].numpy(), ref, rtol=1e-5, atol=1e-6)
            continue
        n, m = shape[0], int(np.prod(shape[1:]))
        q0 = torch.randn(m, 2, generator=seeded_generator(0, key, "init")).double().numpy()
        ref, residuals, q_next = _ref_powersgd([g[key].reshape(n, m) for g in world_grads], q0)
        np.testing.assert_allclose(out[key].reshape(n, m).numpy(), ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(c.residual(key).reshape(n, m).numpy(), residuals[rank],
                                   rtol=1e-4, atol=1e-5)
    # Top-K 30 %: all-gather of values and indices.
    c = TopK(0.3)
    out = synchronize(c, mine, comm)
    for key in SHAPES:
        vs = [g[key].reshape(-1) for g in world_grads]
        ref = _ref_topk(vs, c.k(vs[0].size))
        np.testing.assert_allclose(out[key].reshape(-1).numpy(), ref, rtol=1e-5, atol=1e-6)
    # Random-K 40 %: the same coordinates on every rank, all-reduced values.
    c = RandomK(0.4)
    out = synchronize(c, mine, comm)
    for key in SHAPES:
        vs = [g[key].reshape(-1) for g in world_grads]
        idx = c.indices(key, 0, vs[0].size, c.k(vs[0].size)).numpy()
        ref = np.zeros_like(vs[0])
        ref[idx] = sum(v[idx] for v in vs) / size
        np.testing.assert_allclose(out[key].reshape(-1).numpy(), ref, rtol=1e-5, atol=1e-6)
    # signSGD: majority vote.
    out = synchronize(SignSGD(), mine, comm)
    for key in SHAPES:
        ref = _ref_sign([g[key].reshape(-1) for g in world_grads])
        np.testing.assert_array_equal(out[key].reshape(-1).numpy(), ref)
    # QSGD s = 3 with the documented per-(seed, key, step, rank) uniforms.
    out = synchronize(QSGD(3), mine, comm)
    for key in SHAPES:
        vs = [g[key].reshape(-1) for g in world_grads]
        us = [torch.rand(v.size, generator=seeded_generator(0, key, 0, r)).double().numpy()
              for r, v in enumerate(vs)]
        np.testing.assert_allclose(out[key].reshape(-1).numpy(), _ref_qsgd(vs, us, 3),
                                   rtol=1e-5, atol=1e-6)
    return True


def _check_off_equals_all_reduce(rank, size):
    mine = _grads(rank, 0)
    want = {}
    for k, v in mine.items():
        t = v.clone()
        dist.all_reduce(t)
        want[k] = t / size
    full = max(min(s[0], int(np.prod(s[1:]))) for s in SHAPES.values() if len(s) > 1)
    for spec in (f"powersgd:{full}", "topk:1.0", "randomk:1.0"):
        for step in range(2):
            out = synchronize(_make(spec), mine)
            for k in SHAPES:
                torch.testing.assert_close(out[k], want[k], rtol=1e-5, atol=1e-5,
                                           msg=f"{spec} {k} step {step}")
    return True


def _check_error_feedback(rank, size):
    """After each step, out == mean over ranks of (M_i - residual_i), where M_i is the gradient
    plus the previous residual: the compressed part and the residual add up to the input."""
    for spec in ("powersgd:1", "topk:0.2", "randomk:0.3", "signsgd-ef", "qsgd-ef"):
        c = _make(spec)
        prev = {k: torch.zeros(s) for k, s in SHAPES.items()}
        for step in range(3):
            g = _grads(rank, step)
            out = synchronize(c, g)
            for k in SHAPES:
                m = g[k] + prev[k]
                res = c.residual(k)
                if res is None:       # PowerSGD sends the bias uncompressed: no residual
                    assert spec.startswith("powersgd") and len(SHAPES[k]) == 1
                    continue
                sent = m - res
                if spec.startswith("signsgd"):
                    continue          # the vote is not a mean; checked locally below
                dist.all_reduce(sent)
                torch.testing.assert_close(out[k], sent / size, rtol=1e-5, atol=1e-5,
                                           msg=f"{spec} {k} step {step}")
                prev[k] = res
            if spec.startswith("signsgd"):
                for k in SHAPES:
                    m = g[k] + prev[k]
                    scale = m.abs().mean()
                    torch.testing.assert_close(scale * torch.where(m >= 0, 1.0, -1.0)
                                               + c.residual(k), m, rtol=1e-6, atol=1e-6)
                    prev[k] = c.residual(k)
    return True


def _check_checkpoint(rank, size):
    for spec in ("powersgd:2", "topk:0.2", "randomk:0.3", "signsgd-ef", "qsgd", "qsgd-ef"):
        a = _make(spec)
        for step in range(2):
            synchronize(a, _grads(rank, step))
        level = {"powersgd": 1, "topk": 0.5, "randomk": 0.5, "qsgd": 5}.get(a.name)
        if level is not None:
            a.set_level("fc", level)          # an Accordion switch is part of the state
        buf = io.BytesIO()
        torch.save(a.state_dict(), buf)
        buf.seek(0)
        b = _make(spec)
        b.load_state_dict(torch.load(buf, weights_only=True))
        for step in range(2, 4):
            out_a = synchronize(a, _grads(rank, step))
            out_b = synchronize(b, _grads(rank, step))
            for k in SHAPES:
                assert torch.equal(out_a[k], out_b[k]), f"{spec} {k} step {step}"
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["steps"] == sb["steps"] and sa["levels"] == sb["levels"]
        for k in sa["errors"]:
            assert torch.equal(sa["errors"][k], sb["errors"][k]), f"{spec} residual {k}"
        for k in sa.get("qs", {}):
            assert torch.equal(sa["qs"][k], sb["qs"][k]), f"{spec} warm-start Q {k}"
    return True


def _all_checks(rank, size):
    return [f(rank, size) for f in (_check_references, _check_off_equals_all_reduce,
                                    _check_error_feedback, _check_checkpoint)]


def test_compressors_in_one_process():
    assert _check_references(0, 1)
    assert _check_checkpoint(0, 1)


def test_powersgd_keeps_a_low_rank_gradient_and_warm_starts():
    g = torch.randn(10, 3) @ torch.randn(3, 12)
    c = PowerSGD(3, min_compression_rate=0)
    torch.testing.assert_close(synchronize(c, {"w": g})["w"], g, rtol=1e-4, atol=1e-4)
    q1 = c.state_dict()["qs"]["w"]
    synchronize(c, {"w": g})
    assert not torch.equal(q1, c.state_dict()["qs"]["w"])      # the warm-start Q moved on
    c.set_level("w", 1)                                          # rank drops: Q truncated
    assert synchronize(c, {"w": g})["w"].shape == g.shape
    assert c.state_dict()["qs"]["w"].shape == (12, 1)


def test_powersgd_small_tensors_go_uncompressed():
    c = PowerSGD(4)                  # min_compression_rate 2: 8x8 at rank 4 is rate 1
    assert c.uncompressed((8, 8)) and not c.uncompressed((64, 64)) and c.uncompressed((100,))
    g = torch.randn(8, 8)
    assert torch.equal(synchronize(c, {"w": g})["w"], g)
    assert c.payload_bytes((8, 8)) == 256 and c.payload_bytes((64, 64)) == 4 * 128 * 4


def test_payload_bytes_match_what_is_sent():
    for spec in ("powersgd:2", "topk:0.1", "randomk:0.1", "signsgd", "qsgd:3", "qsgd:300"):
        c = _make(spec)
        comm = Comm()
        synchronize(c, {"w": torch.randn(40, 30)}, comm)
        assert comm.bytes_sent == c.payload_bytes((40, 30)), spec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_compressed_in_float32(dtype):
    """bf16/fp16 gradients give exactly what their float32 values give (residuals included):
    the compressors compute in float32 (PowerSGD orthogonalises in float32)."""
    for spec in ("powersgd:2", "topk:0.2", "randomk:0.3", "signsgd-ef", "qsgd-ef"):
        half, full = _make(spec), _make(spec)
        for step in range(3):
            g = {k: v.to(dtype) for k, v in _grads(0, step).items()}
            out_half = synchronize(half, g)
            out_full = synchronize(full, {k: v.float() for k, v in g.items()})
            for k in SHAPES:
                assert out_half[k].dtype == torch.float32, f"{spec} {k}"
                assert torch.equal(out_half[k], out_full[k]), f"{spec} {k} step {step}"


def test_residual_is_a_copy_of_what_is_updated_in_place():
    c = _make("topk:0.2")
    synchronize(c, _grads(0, 0))
    before = c.residual("fc")
    synchronize(c, _grads(0, 1))
    assert not torch.equal(before, c.residual("fc"))       # the kept one moved on, the copy not
    assert not torch.equal(before, torch.zeros_like(before))


def test_pack_bits_round_trip():
    bits = torch.rand(37, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 5
    assert torch.equal(unpack_bits(packed, 37), bits)


def test_qsgd_is_unbiased_and_within_one_level():
    v = torch.randn(50, generator=torch.Generator().manual_seed(3))
    norm = torch.linalg.vector_norm(v)
    acc = torch.zeros(50)
    for seed in range(400):
        c = QSGD(2, seed=seed)
        out = synchronize(c, {"v": v})["v"]
        assert (out - v).abs().max() <= norm / 2 + 1e-6
        acc += out
    assert (acc / 400 - v).abs().max() < 0.15 * norm / 2


@pytest.mark.parametrize("bad, match", [
    (lambda: PowerSGD(0), "rank 0"),
    (lambda: make_compressor("powersgd:-1"), "rank -1"),
    (lambda: TopK(0.0), "fraction 0.0"),
    (lambda: RandomK(1.5), "fraction 1.5"),
    (lambda: make_compressor("topk:2"), "fraction 2.0"),
    (lambda: QSGD(0), "levels 0"),
    (lambda: make_compressor("zip:3"), "unknown compressor 'zip'"),
    (lambda: make_compressor("signsgd:2"), "signsgd takes no level"),
    (lambda: make_compressor("topk:abc"), "'abc' is not a number"),
    (lambda: PowerSGD(2).set_level("w", 0), "rank 0"),
    (lambda: SignSGD().set_level("w", 2), "no compression level"),
    (lambda: synchronize(TopK(0.5), {"w": torch.ones(3)}, Comm(all_gather=False)),
     "needs all-gather"),
])
def test_bad_input_is_a_clear_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_registry_names():
    assert set(COMPRESSORS) == {"powersgd", "topk", "randomk", "signsgd", "qsgd", "none"}
    assert [make_compressor(s).spec() for s in ("powersgd:4", "topk:0.01", "signsgd")] == \
        ["powersgd:4", "topk:0.01", "signsgd"]


# --- the spec as data (tidal.ir.compression_model), shared with the runtime ---------------------

def test_spec_grammar_round_trips_with_options():
    from tidal.ir.compression_model import parse_spec

    for text in ("powersgd:2,min_compression_rate=0", "powersgd:4,warm_start=false,seed=7",
                 "topk:0.0123456789", "signsgd,error_feedback=true", "qsgd:300", "none"):
        spec = parse_spec(text)
        assert str(spec) == text and str(parse_spec(str(spec))) == text
        c = make_compressor(text)
        assert c.spec() == text and c.spec_data() == spec
    assert str(parse_spec(" PowerSGD : 4 , seed = 0 ")) == "powersgd:4"   # defaults dropped
    assert make_compressor("powersgd:2,min_compression_rate=0").min_compression_rate == 0.0
    assert make_compressor("powersgd:2,seed=1", seed=2).seed == 2             # keyword wins


@pytest.mark.parametrize("text, match", [
    ("powersgd:2,rate=1", "'rate=1' is not an option of powersgd"),
    ("powersgd:2,seed", "'seed' is not an option"),
    ("topk:0.1,error_feedback=maybe", "error_feedback='maybe' is not true or false"),
    ("qsgd:4,seed=x", "seed='x' is not a number"),
    ("powersgd:2,min_compression_rate=-1", "min_compression_rate=-1.0\\): must be >= 0"),
    ("none:1", "none takes no level"),
])
def test_bad_spec_options_are_named(text, match):
    from tidal.ir.compression_model import parse_spec

    with pytest.raises(ValueError, match=match):
        parse_spec(text)


def test_runtime_classes_take_the_ir_defaults():
    """A runtime compressor's constructor defaults are the spec's, so ``spec()`` writes only
    what was set, and its sizes are the ones the pass plans with."""
    import inspect

    from tidal.ir.compression_model import KINDS, parse_spec

    for name, cls in COMPRESSORS.items():
        kind = KINDS[name]
        params = dict(inspect.signature(cls.__init__).parameters)
        del params["self"]
        assert {k: params.pop(k).default for k in kind.defaults} == kind.defaults, name
        assert [p.default for p in params.values()] == (
            [] if kind.level_noun is None else [kind.default_level]), name   # the level
        c = cls()
        assert c.default_level == kind.default_level and c.spec() == str(parse_spec(name))
        assert (c.all_reduce_compatible, c.rounds) == (kind.all_reduce, kind.rounds)
        for shape in ((40, 30), (7,), (6, 3, 2, 2), (1000,)):
            assert c.payload_bytes(shape) == parse_spec(c.spec()).payload_bytes(shape)


def background_job(items):
    """The 4-rank case's job, queued in the background when collection ends
    (``tests/conftest.py``): it runs while this module's other tests, above it, do; a failed
    or unstarted one runs in its test. The 2-rank case spawns its own."""
    return sized_job(items, "test_compressors_on_gloo_ranks", _all_checks, 4)


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_compressors_on_gloo_ranks(size, request, background_jobs):
    ranks = background_jobs.result(request.module.__name__, Job(_all_checks, size))
    assert ranks == [[True] * 4] * size
