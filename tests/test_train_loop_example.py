"""examples/train_loop.py, the README's complete training loop (AdamW with two groups, warm-up +
cosine, clipping, accumulation 4 with no_sync, DistributedSampler batches with
compile(batch="local"), eval, ONE DCP checkpoint of model, optimizer, scheduler and runtime
state, and a resume from it) under every training pass on two gloo ranks: the same losses as
DDP (float32: <= train_loop.TOL), tick_tock's as its Eq. 1 reference
(tests/tick_tock_reference.py), and the resumed run's as the uninterrupted run's (bit for
bit). One spawned job runs every pass."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tidal.runtime.distributed import spawn

from tick_tock_reference import Eq1Reference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_loop  # noqa: E402
sys.path.pop(0)

STEPS = 4
PASSES = ("compression", "burst_parallel", "tick_tock", "round_robin")


class Both:
    """Two optimizers (or schedulers) stepped, zeroed, ... together."""

    def __init__(self, *objs):
        self.objs = objs

    def __getattr__(self, name):
        return lambda *a, **k: [getattr(o, name)(*a, **k) for o in self.objs]


class Eq1Runner(train_loop.Runner):
    """The loop's runner on tick_tock's reference: Eq. 1 over two copies of the model on the
    global batch (the ranks' DistributedSampler batches joined in rank order)."""

    def __init__(self, model):
        self.ref = Eq1Reference(model, F.cross_entropy)
        self.net = self.ref.tick

    def optimizers(self, steps):
        (opt_t, sched_t), (opt_k, sched_k) = (train_loop.make_optimizer(m.parameters(), steps)
                                              for m in (self.ref.tick, self.ref.tock))
        return Both(opt_t, opt_k), Both(sched_t, sched_k)

    def backward(self, x, y, scale):
        joined = []
        for t in (x, y):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            joined.append(torch.cat(parts))
        return float(self.ref.backward(*joined, scale))

    def no_sync(self):
        return self.ref.no_sync()

    def clip(self, max_norm):
        return float(self.ref.clip_grad_norm_(max_norm))

    def save(self, path, opt, sched):
        pass   # the reference is only compared with the uninterrupted run


def _every_pass(rank, world, ckpt):
    results = {}
    for name in PASSES:
        results[name] = train_loop.compare(name, STEPS, False, ckpt)
    results["bf16"] = train_loop.compare("burst_parallel", STEPS, True, ckpt)
    results["eq1"] = train_loop.train(Eq1Runner, STEPS, False, ckpt + "/eq1", False)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("train_loop"))
    return spawn(_every_pass, 2, ckpt, timeout_s=900)


def test_one_process_loop_equals_eager_and_resumes(tmp_path):
    result = train_loop.compare("none", STEPS, False, str(tmp_path))
    assert result.versus_ddp == 0.0 and result.resume_diff == 0.0
    assert len(result.tidal) == STEPS + 1 and len(result.resumed) == STEPS // 2 + 1


@pytest.mark.parametrize("name", [p for p in PASSES if p != "tick_tock"] + ["bf16"])
def test_two_ranks_equal_ddp_and_resume_bit_for_bit(two_ranks, name):
    for result in two_ranks:          # every rank saw the same losses
        assert result[name].tidal == two_ranks[0][name].tidal
    result = two_ranks[0][name]
    tol = 2e-3 if name == "bf16" else train_loop.TOL    # bf16: the same casts, other sums
    assert result.versus_ddp <= tol, train_loop.report(result, name == "bf16")
    assert result.resume_diff == 0.0, train_loop.report(result, name == "bf16")


def test_two_ranks_tick_tock_equals_eq1_and_resumes_bit_for_bit(two_ranks):
    result, eq1 = two_ranks[0]["tick_tock"], two_ranks[0]["eq1"]
    assert eq1.keys() == result.tidal.keys()
    worst = max(abs(result.tidal[k] - eq1[k]) for k in eq1)
    assert worst <= train_loop.TOL, (result.tidal, eq1)
    assert result.resume_diff == 0.0
    assert result.versus_ddp > 10 * train_loop.TOL   # Eq. 1 is not DDP: the test can fail


def test_report_prints_the_checks(two_ranks):
    text = train_loop.report(two_ranks[0]["tick_tock"], False)
    assert "Eq. 1" in text and "for information" in text
    text = train_loop.report(two_ranks[0]["round_robin"], False)
    assert "(equal; float32 tolerance 1e-05)" in text and "resumed from the DCP" in text
