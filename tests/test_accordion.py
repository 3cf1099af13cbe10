"""Accordion: switches exactly where Algorithm 1 says on scripted norms; the accumulated-gradient
path computes those norms; rank 0 decides for everyone; state round-trips; the batch-size
variant scales the learning rate linearly."""
import io

import pytest
import torch

from tidal.runtime.comm.accordion import Accordion, AccordionBatch, is_critical
from tidal.runtime.comm.compressors import PowerSGD
from tidal.runtime.distributed import spawn

# window norms of two layers, the learning rate now and next window, and the rule's verdict:
# critical iff first window, |prev - curr| / prev >= 0.5, or lr_next < lr_now.
SCRIPT = [
    # (norm a, norm b, lr_now, lr_next) -> (a critical, b critical)
    ((10.0, 2.0, 0.1, 0.1), (True, True)),      # first window
    ((4.0, 1.9, 0.1, 0.1), (True, False)),      # a: 6/10 = 0.6 >= 0.5; b: 0.05
    ((3.5, 0.9, 0.1, 0.1), (False, True)),      # a: 0.125; b: 1.0/1.9 = 0.526
    ((1.75, 0.5, 0.1, 0.1), (True, False)),     # a: exactly 0.5 (>=); b: 0.4/0.9 = 0.444
    ((1.7, 0.45, 0.1, 0.01), (True, True)),     # learning-rate decay ahead
    ((1.6, 0.5, 0.01, 0.01), (False, False)),   # a: 0.059; b: 0.111
    ((3.3, 0.5, 0.01, 0.01), (True, False)),    # a rise counts too: 1.7/1.6 = 1.06
]


def test_switches_exactly_where_the_rule_says():
    acc = Accordion(low=4, high=1)
    for (a, b, lr_now, lr_next), (crit_a, crit_b) in SCRIPT:
        levels = acc.decide_from_norms({"a": a, "b": b}, lr_now, lr_next)
        assert levels == {"a": 4 if crit_a else 1, "b": 4 if crit_b else 1}, (a, b)
    assert [set(h) for h in acc.history] == [
        {k for k, c in zip("ab", crit) if c} for _, crit in SCRIPT]


def test_is_critical_edge_cases():
    assert is_critical(None, 1.0)
    assert is_critical(0.0, 1.0) and not is_critical(0.0, 0.0)
    assert is_critical(2.0, 1.0, eta=0.5) and not is_critical(2.0, 1.01, eta=0.5)
    assert is_critical(2.0, 2.0, lr_now=1.0, lr_next=0.5)
    assert not is_critical(2.0, 2.0, lr_now=0.5, lr_next=1.0)   # an increase is not a decay


def _direction(shape, seed):
    v = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return v / torch.linalg.vector_norm(v)


def test_accumulated_gradients_give_the_scripted_norms():
    """Each window is three steps whose gradients sum to norm * unit vector (the exact 0.5
    boundary moved off by 0.01: float sums cannot promise which side they land)."""
    scripted, measured = Accordion(4, 1), Accordion(4, 1)
    for w, ((a, b, lr_now, lr_next), _) in enumerate(SCRIPT):
        a = 1.74 if a == 1.75 else a
        ua, ub = _direction((5, 4), w), _direction((7,), 100 + w)
        for part in (0.5, 0.3, 0.2):
            measured.accumulate({"a": ua * a * part, "b": ub * b * part})
        assert measured.decide(lr_now, lr_next) == scripted.decide_from_norms(
            {"a": a, "b": b}, lr_now, lr_next)


def test_apply_sets_compressor_levels():
    c = PowerSGD(4)
    acc = Accordion(4, 1)
    acc.decide_from_norms({"w": 1.0})
    acc.apply(c, acc.decide_from_norms({"w": 0.99}))
    assert c.level("w") == 1 and c.level("other") == 4


def test_state_round_trip_continues_identically():
    a = Accordion(4, 1)
    for (na, nb, lr_now, lr_next), _ in SCRIPT[:3]:
        a.decide_from_norms({"a": na, "b": nb}, lr_now, lr_next)
    a.accumulate({"a": torch.ones(3)})
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = Accordion(4, 1)
    b.load_state_dict(torch.load(buf))
    assert b.history == a.history
    for (na, nb, lr_now, lr_next), _ in SCRIPT[3:]:
        a.accumulate({"a": torch.full((3,), na), "b": torch.full((2,), nb)})
        b.accumulate({"a": torch.full((3,), na), "b": torch.full((2,), nb)})
        assert a.decide(lr_now, lr_next) == b.decide(lr_now, lr_next)
    assert a.history == b.history


def test_batch_size_variant_switches_batch_and_scales_lr():
    acc = AccordionBatch(b_low=512, b_high=4096, lr_low=0.4)
    first = acc.decide_from_norm(10.0)
    assert (first.batch, first.lr, first.critical) == (512, 0.4, True)
    calm = acc.decide_from_norm(9.0)                       # 0.1 < 0.5
    assert (calm.batch, calm.critical) == (4096, False)
    assert calm.lr == pytest.approx(0.4 * 8)               # linear scaling, 8x
    decay = acc.decide_from_norm(9.0, lr_scale_now=1.0, lr_scale_next=0.1)
    assert (decay.batch, decay.critical) == (512, True) and decay.lr == pytest.approx(0.04)
    acc.accumulate({"w": torch.full((4,), 1.0), "v": torch.full((9,), 1.0)})  # norm 13^0.5
    assert acc.decide().batch == 512                        # |9 - 3.6| / 9 >= 0.5
    assert acc.history[-1] == ("model",)


@pytest.mark.parametrize("bad, match", [
    (lambda: Accordion(4, 1, eta=0), "eta=0"),
    (lambda: AccordionBatch(0, 8, 0.1), "b_low=0"),
    (lambda: AccordionBatch(64, 8, 0.1), "b_high < b_low"),
    (lambda: AccordionBatch(8, 64, -1.0), "lr_low=-1.0"),
])
def test_bad_input_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def _rank_zero_decides(rank, size):
    acc = Accordion(4, 1)
    # Different norms on each rank: only rank 0's count.
    acc.decide_from_norms({"w": 10.0})
    return acc.decide_from_norms({"w": 1.0 if rank == 0 else 10.0})["w"]


def test_decision_is_made_on_rank_zero_and_broadcast():
    assert spawn(_rank_zero_decides, 2) == [4, 4]


# --- a learning-rate decay ahead (the schedule is known) ------------------------------------

SCHEDULE = lambda step: 0.1 if step < 6 else 0.01  # noqa: E731   steps 0-5 at 0.1, then 0.01


def _steps_until_decisions(lookahead, steps=12, interval=3, **options):
    """Run the compression executor on one process with a gradient that never changes (so
    only the first window and a decay can be critical), the learning rate following SCHEDULE
    (applied by MultiStepLR, milestone 6), and return per window whether it was critical, and
    the learning rates the optimizer used. ``lookahead``: the schedule function (read into the
    plan), "scheduler" (the executor peeks the MultiStepLR) or None (no lookahead); ``options``
    go to the pass."""
    import tidal
    from tidal.passes.compression import CompressionPass

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2, bias=False)   # loss = sum of outputs: a constant rank-1
    x = torch.ones(2, 4)                          # gradient, which rank-1 PowerSGD keeps exactly
    sched_holder = {}
    compiled = tidal.compile(
        model, x, passes=[CompressionPass(
            compressor="powersgd:2,min_compression_rate=0", accordion=(2, 1),
            accordion_interval=interval,
            accordion_lr_schedule=lookahead if callable(lookahead) else None, **options)],
        loss_fn=lambda out, y: out.sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    sched_holder["s"] = torch.optim.lr_scheduler.MultiStepLR(compiled.optimizer, [6], 0.1)
    if lookahead == "scheduler":
        compiled.executor.watch_scheduler(sched_holder["s"])
    used = []
    for _ in range(steps):
        used.append(compiled.optimizer.param_groups[0]["lr"])
        compiled.step((x,), torch.zeros(2, 2))
        sched_holder["s"].step()
    return [bool(h) for h in compiled.executor.accordion.history], used


def test_decay_ahead_is_critical_for_the_window_that_runs_at_the_new_rate():
    # windows of 3 steps end after steps 3, 6, 9, 12; the decisions there set the level of
    # the next window. After step 3: the first window (critical). After step 6: steps 6-8 run
    # at the decayed rate, a decay ahead (critical). After 9 and 12: calm.
    crit, used = _steps_until_decisions(SCHEDULE)
    assert crit == [True, True, False, False]
    assert used == pytest.approx([SCHEDULE(s) for s in range(12)])
    # the scheduler route: the MultiStepLR peeked (never advanced: same rates used)
    assert _steps_until_decisions("scheduler") == (crit, used)
    # no lookahead: the drop is seen after step 9, when the window 6-8 already ran
    assert _steps_until_decisions(None) == ([True, False, True, False], used)
    # the schedule read for 6 steps only: the window 6-8 lies beyond, seen late as without
    assert _steps_until_decisions(SCHEDULE, accordion_lr_horizon=6) == \
        ([True, False, True, False], used)


def test_peek_leaves_scheduler_and_optimizer_untouched():
    from tidal.runtime.comm.accordion import LrLookahead, peek_scheduler_lrs

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt.step()
    sched.step()
    before = (sched.state_dict(), opt.param_groups[0]["lr"])
    assert peek_scheduler_lrs(sched, 4) == [0.5, 0.5, 0.25, 0.25]
    assert (sched.state_dict(), opt.param_groups[0]["lr"]) == before
    ahead = LrLookahead.from_scheduler(sched, steps_per_call=2)   # a per-"epoch" scheduler
    assert ahead.now_and_next(steps_done=0, interval=4, current_lr=0.5) == (0.5, 0.5)
    assert ahead.now_and_next(0, 6, 0.5) == (0.5, 0.25)             # 3 calls ahead
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        LrLookahead.from_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ValueError, match="steps_per_call=0"):
        LrLookahead.from_scheduler(sched, 0)
    with pytest.raises(TypeError, match="callable"):
        LrLookahead.from_function(0.1)
