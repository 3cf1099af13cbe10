"""The performance model (Eq. 4.1 with k buckets, overlap, gamma, encode/decode) and
``tidal whatif``."""
import argparse

import pytest

from tidal.compiler import cli_whatif
from tidal.ir import perf_model as pm
from tidal.ir.cluster import Cluster
from tidal.runtime.comm.compressors import PowerSGD, TopK
from tidal.runtime.comm.compressors.modeling import compressor_cost, measure_encode_decode_s

GB = 1e9 / 8          # bytes per second in one Gb/s


def _cluster(p=64, gbps=10.0, us=10.0):
    return Cluster(gpus=p, bandwidth_gbps=gbps, latency_us=us)


def test_ring_all_reduce_is_eq_4_1():
    for p, b, gbps, us in [(2, 1e6, 10, 5), (64, 25 * 2**20, 10, 10), (8, 123.0, 1, 0)]:
        alpha, bw = us * 1e-6, gbps * GB
        want = 2 * alpha * (p - 1) + 2 * b * (p - 1) / (p * bw)
        assert pm.ring_all_reduce_s(b, _cluster(p, gbps, us)) == pytest.approx(want, rel=1e-12)
    assert pm.ring_all_reduce_s(1e6, _cluster(p=1)) == 0.0


def test_all_gather_grows_with_gpus_ring_does_not():
    b = 10e6
    ring = [pm.ring_all_reduce_s(b, _cluster(p, us=0)) for p in (8, 64)]
    gather = [pm.all_gather_s(b, _cluster(p, us=0)) for p in (8, 64)]
    assert ring[1] / ring[0] == pytest.approx((63 / 64) / (7 / 8))
    assert gather[1] / gather[0] == pytest.approx(63 / 7)


def test_uniform_buckets_are_k_minus_1_full_and_a_last_one():
    w = pm.Workload.uniform(0.1, 0.2, total_bytes=60 * 2**20)
    assert w.bucket_bytes == (25 * 2**20, 25 * 2**20, 10 * 2**20)
    assert pm.Workload.uniform(0.1, 0.2, total_bytes=5.0).bucket_bytes == (5.0,)


def test_bucket_partition_is_greedy_in_order_and_closes_at_the_cap_as_ddp():
    sizes = [10, 5, 20, 1, 1, 30, 4]
    parts = pm.bucket_partition(sizes, cap_bytes=16)
    assert [i for b in parts for i in b] == list(range(len(sizes)))
    assert parts == ((0, 1, 2), (3, 4, 5), (6,))   # DDP: closed once at or past the cap
    with pytest.raises(ValueError, match="bucket cap 0"):
        pm.bucket_partition(sizes, 0)


def test_sync_step_overlaps_all_but_the_last_bucket():
    work = pm.Workload(fwd_s=0.1, bwd_s=0.3, bucket_bytes=(1e6, 1e6, 5e5))
    c = _cluster(8, 10, 10)
    comms = [pm.ring_all_reduce_s(b, c) for b in work.bucket_bytes]
    t = pm.sync_sgd_step(work, c, gamma=1.1)
    assert sum(comms[:2]) < 1.1 * 0.3                  # compute-bound: comm hidden
    assert t.total_s == pytest.approx(0.1 + 1.1 * 0.3 + comms[2])
    slow = _cluster(8, 0.01, 10)
    comms = [pm.ring_all_reduce_s(b, slow) for b in work.bucket_bytes]
    assert pm.sync_sgd_step(work, slow, 1.1).total_s == pytest.approx(0.1 + sum(comms))
    assert pm.sync_sgd_step(work, _cluster(p=1)).total_s == pytest.approx(0.4)


def test_compressed_step_is_not_overlapped_and_pays_encode_decode():
    work = pm.Workload(0.1, 0.3, (4e6, 2e6))
    comp = pm.CompressorCost("x", (1e4, 5e3), encode_decode_s=0.05, all_reduce=True, rounds=2)
    c = _cluster(16, 10, 10)
    want = 0.1 + 0.3 + 0.05 + 2 * (pm.ring_all_reduce_s(1e4, c) + pm.ring_all_reduce_s(5e3, c))
    assert pm.compressed_step(work, comp, c).total_s == pytest.approx(want)
    gather = pm.CompressorCost("g", (1e4, 5e3), 0.05, all_reduce=False)
    assert pm.compressed_step(work, gather, c).comm_s == pytest.approx(
        pm.all_gather_s(1e4, c) + pm.all_gather_s(5e3, c))


def test_crossover_bandwidth_is_where_the_times_meet():
    work = pm.Workload.uniform(0.1, 0.2, 170 * 2**20)
    comp = pm.CompressorCost.ratio("p", work, ratio=50, encode_decode_s=0.08, all_reduce=True,
                                   rounds=2)
    c = _cluster()
    x = pm.crossover_bandwidth_gbps(work, comp, c)
    assert x is not None and 1 < x < 100
    at = Cluster(gpus=64, bandwidth_gbps=x, latency_us=10)
    assert pm.sync_sgd_step(work, at).total_s == pytest.approx(
        pm.compressed_step(work, comp, at).total_s, rel=1e-6)
    assert pm.speedup(work, comp, Cluster(gpus=64, bandwidth_gbps=x / 2)) > 1
    assert pm.speedup(work, comp, Cluster(gpus=64, bandwidth_gbps=x * 2)) < 1
    free = pm.CompressorCost.ratio("free", work, 50, 0.0, True)      # no encode cost: always
    assert pm.crossover_bandwidth_gbps(work, free, c) is None        # at least as fast


def test_required_compression_is_the_smallest_ratio_that_scales():
    work = pm.Workload.uniform(0.05, 0.1, 170 * 2**20)
    c = _cluster(64, 10, 10)
    r = pm.required_compression(work, c, gamma=1.05, tolerance=0.1)
    assert r is not None and r > 1
    target = 1.1 * (0.05 + 0.1)                   # 10 % over the single-GPU step

    def step(ratio):
        return pm.sync_sgd_step(pm.Workload(0.05, 0.1, tuple(b / ratio for b in
                                                             work.bucket_bytes)), c).total_s
    assert step(r) <= target * (1 + 1e-9) and step(r * 0.99) > target
    assert pm.required_compression(work, _cluster(64, 1e5, 0)) == 1.0
    assert pm.required_compression(work, _cluster(64, 10, 1e5)) is None   # latency-bound
    assert pm.required_compression(work, _cluster(64, 1e5, 0), gamma=1.2) is None  # gamma
    with pytest.raises(ValueError, match="tolerance -0.1"):
        pm.required_compression(work, c, tolerance=-0.1)


def test_required_compression_on_a_constructed_case():
    """2 GPUs, no latency, 4 equal buckets whose all-reduce takes t = b / BW = 0.2 s each;
    forward 0.1 s, backward 0.3 s, gamma 1. Compressed c times, a step is
    0.1 + max(0.3, 3 t / c) + t / c; within 10 % of one GPU's 0.4 s means 0.4 + 0.2 / c <=
    0.44 (once 0.6 / c <= 0.3), so c = 5 exactly: the overlapped buckets are hidden from c = 2
    on, and the exposed last bucket sets the ratio."""
    b = 0.2 * 1e9 / 8                               # bytes a 1 Gb/s link moves in 0.2 s
    work = pm.Workload(0.1, 0.3, (b,) * 4)
    c = _cluster(2, 1, 0)
    assert pm.ring_all_reduce_s(b, c) == pytest.approx(0.2)
    assert pm.required_compression(work, c, gamma=1.0, tolerance=0.1) == pytest.approx(5.0)
    # 20 %: 0.4 + 0.2 / c <= 0.48 gives 2.5; 0 %: only an infinite ratio, i.e. unreachable
    assert pm.required_compression(work, c, gamma=1.0, tolerance=0.2) == pytest.approx(2.5)
    assert pm.required_compression(work, c, gamma=1.0, tolerance=0.0) is None
    # the CLI's Fig. 4.8 rows: smaller batches (less backward to hide behind) need more
    stats = cli_whatif.model_stats("resnet101")
    rows = cli_whatif.required_by_batch(stats, (16, 32, 64), _cluster(64, 10, 10))
    assert [b for b, _ in rows] == [16, 32, 64]
    assert rows[0][1] > rows[1][1] > rows[2][1] >= 1


def test_compressor_cost_matches_payload_bytes():
    shapes = [[(64, 32), (64,)], [(128, 64, 3, 3)]]
    for comp in (PowerSGD(2), TopK(0.05)):
        cost = compressor_cost(comp, shapes, 0.01)
        assert cost.total_payload == pytest.approx(
            sum(comp.payload_bytes(s) for b in shapes for s in b))
        assert cost.all_reduce == comp.all_reduce_compatible
    assert measure_encode_decode_s(PowerSGD(2), [(64, 32)], repeats=2) > 0


def test_v100_throughput_constant_matches_its_derivation():
    stats = cli_whatif.model_stats("resnet50")
    per_image = stats.fwd_flops_per_sample + stats.bwd_flops_per_sample
    assert 367 * per_image / 1e12 == pytest.approx(cli_whatif.V100_FP32_TFLOPS, rel=0.01)
    assert stats.params == cli_whatif.TABLE_4_1_PARAMS


def test_whatif_resnet101_on_64_v100s(capsys):
    p = argparse.ArgumentParser()
    cli_whatif.add_arguments(p)
    args = p.parse_args(["--model", "resnet101", "--batch", "64", "--gpus", "64",
                         "--bandwidth", "10Gbps", "--compressor", "powersgd:4", "--sweep", "1,30"])
    assert cli_whatif.run(args) == 0
    out = capsys.readouterr().out
    assert "44,549,160 parameters" in out and "crossover bandwidth:" in out
    stats = cli_whatif.model_stats("resnet101")
    w = cli_whatif.what_if(stats, 64, _cluster(64, 10, 10), PowerSGD(4))
    # The paper (Fig. 4.10) puts the crossover near 8.2 Gb/s; the model must land nearby.
    assert w.crossover_gbps is not None and 4 < w.crossover_gbps < 16
    slow = cli_whatif.what_if(stats, 64, _cluster(64, 1, 10), PowerSGD(4))
    assert slow.speedup > 1 and (w.speedup < 1) == (w.crossover_gbps < 10)


@pytest.mark.parametrize("argv, match", [
    (["--bandwidth", "fast"], "bandwidth 'fast'"),
    (["--compressor", "zip:1"], "unknown compressor 'zip'"),
    (["--gpus", "0"], "'0' must be at least 1"),
])
def test_whatif_bad_arguments(argv, match, capsys):
    p = argparse.ArgumentParser()
    cli_whatif.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(argv)
    assert match in capsys.readouterr().err


def test_whatif_unknown_model_is_one_line(capsys):
    p = argparse.ArgumentParser()
    cli_whatif.add_arguments(p)
    assert cli_whatif.run(p.parse_args(["--model", "resnet9000"])) == 2
    err = capsys.readouterr().err
    assert "'resnet9000'" in err and len(err.strip().splitlines()) == 1
