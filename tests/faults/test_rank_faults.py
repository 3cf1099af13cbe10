"""Faults of one rank during training on 2 gloo ranks (issue #35 items 2 and 9): a rank that
raises inside a step which its script catches (the ranks then a step apart: every later
collective would pair step k with step k + 1) raises ``StepMismatchError`` on both ranks at the
next loss all-reduce (burst_parallel: at its step check); in the same job, one rank's NaN rows
under ``check_finite=True`` make every rank raise ``NonFiniteLossError`` naming the step, and an
empty global batch a ``BatchError``, every rank's parameters left as they were. The fault is
injected where a step begins on the faulty rank (its rank program's ``bind``), after the batch
check every rank made. Also in that job (issue #35, the batch check at no extra round): rank 1
given another global batch than rank 0 under ``check_batch`` (the default) raises ``BatchError``
naming the input on every rank under each training pass, parameters as before; a matching step
under data parallelism makes no all-gather (the check rides on the loss all-reduce). A peer
killed or stalled: ``test_peer_faults.py``."""
import time

import pytest
import torch
import torch.distributed as dist

import tidal
from tidal.compiler.step_checks import NonFiniteLossError
from tidal.runtime.distributed import spawn

from .fault_cases import PG_TIMEOUT_S, TRAINING_PASSES, compiled, fault_at_next_bind

STEP_APART = ("compression", "round_robin", "burst_parallel")


def _raise():
    raise RuntimeError("injected fault")


def _a_step_apart(rank, world):
    """Per pass: rank 1's step 1 raises and its script goes on; the first StepMismatchError
    a later step raises on this rank (its step, every rank's, the message; '' for none). Then
    :func:`_bad_batches` under compression and burst_parallel (by ``"nan <pass>"``)."""
    out = {}
    for name in STEP_APART:
        c, x, y = compiled(name, check_batch=False)
        out[name] = ""
        for step in range(4):
            if rank == 1 and step == 1:
                fault_at_next_bind(c, _raise)
            before = [p.detach().clone() for p in c.model.parameters()]
            try:
                c.step((x,), y)
            except tidal.StepMismatchError as e:
                kept = all(torch.equal(a, p) for a, p in zip(before, c.model.parameters()))
                out[name] = f"{e.step} {list(e.steps)} {e}"
                out[name, "kept"] = kept
                break
            except RuntimeError as e:
                assert rank == 1 and step == 1 and "injected fault" in str(e), e
    for name in ("compression", "burst_parallel"):
        out[f"nan {name}"] = _bad_batches(rank, name)
    for name in TRAINING_PASSES:
        out[f"batch {name}"] = _different_batches(rank, name)
    out["gathers"] = _all_gathers_of_a_step() + _all_gathers_of_a_step("tick_tock")
    return out


def _different_batches(rank, name):
    """Under pass ``name`` with the batch check on: a good step, then one where rank 1's
    global batch differs from rank 0's in one element, then a good step again. What this rank
    saw of the bad one (the error's type and message, or 'no error'), whether the parameters
    are as before it, and whether the last step's loss is finite."""
    c, x, y = compiled(name)
    c.step((x,), y)
    bad = x.clone()
    if rank == 1:
        bad[3, 2] += 1.0
    before = [p.detach().clone() for p in c.model.parameters()]
    try:
        c.step((bad,), y)
        seen = "no error"
    except tidal.BatchError as e:
        seen = f"{type(e).__name__} {e}"
    kept = all(torch.equal(a, p) for a, p in zip(before, c.model.parameters()))
    return seen, kept, bool(torch.isfinite(c.step((x,), y)))


def _all_gathers_of_a_step(name="compression"):
    """How many all-gathers (any of torch.distributed's) a matching step makes with the batch
    check on, under data parallelism (the compression pass, no compressor) or ``tick_tock``:
    0, the check riding on the loss all-reduce (it was one all-gather of the batch headers
    per step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    passes = dict(passes=["compression"], compressor="none") if name == "compression" else \
        dict(passes=TRAINING_PASSES[name](2))
    c = tidal.compile(model, (x,), example_targets=y, loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), **passes)
    c.step((x,), y)   # the first step (the broadcast, the program's agreement) aside
    names = [n for n in dir(dist) if n.startswith("all_gather") or n == "_all_gather_base"]
    calls = []
    originals = {n: getattr(dist, n) for n in names}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call
    try:
        for n in names:
            setattr(dist, n, counted(n))
        c.step((x,), y)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return calls


def _bad_batches(rank, name):
    """Under ``compile(batch="local", check_finite=True)`` with 4 rows per rank: a good step,
    then one where rank 1's rows hold a NaN, then an empty batch on every rank, then a good
    step. What this rank saw: per bad step the error (type, step number, whether the
    parameters are as before it), and whether the last step's loss is finite."""
    full_x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    full_y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    x, y = full_x[4 * rank:4 * rank + 4], full_y[4 * rank:4 * rank + 4]
    c, _, _ = compiled(name, x=x, y=y, batch="local", check_finite=True)
    c.step((x,), y)
    bad = x.clone()
    if rank == 1:
        bad[2, 5] = float("nan")
    seen = []
    for inputs, targets in (((bad,), y), ((x[:0],), y[:0])):
        before = [p.detach().clone() for p in c.model.parameters()]
        try:
            c.step(inputs, targets)
            seen.append("no error")
        except (NonFiniteLossError, tidal.BatchError) as e:
            kept = all(torch.equal(a, p) for a, p in zip(before, c.model.parameters()))
            seen.append(f"{type(e).__name__} {getattr(e, 'step', '-')} {kept} {e}")
    seen.append(f"finite {bool(torch.isfinite(c.step((x,), y)))}")
    return seen


@pytest.mark.slow
def test_ranks_a_step_apart_raise_step_mismatch_on_every_rank():
    """Was: silent, rank 0's step k trained with rank 1's step k + 1 (the loss all-reduce
    summed them)."""
    started = time.monotonic()
    out = spawn(_a_step_apart, 2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    assert time.monotonic() - started < 120
    for rank, mine in enumerate((2, 3)):   # rank 0's step 2 met rank 1's step 3 (its 2nd)
        for name in STEP_APART:
            message = out[rank][name]
            assert message.startswith(f"{mine} [2, 3] {name}: the ranks are on different "
                                      f"steps: this rank on step {mine}"), (rank, message)
            assert out[rank][name, "kept"], (rank, name)   # raised before any update
        for name in ("compression", "burst_parallel"):   # item 9 on 2 ranks: every rank
            nan, empty, after = out[rank][f"nan {name}"]    # raises, nothing trains on
            assert nan.startswith("NonFiniteLossError 2 True Compiled.step: the loss of step "
                                  "2 is nan"), (rank, name, nan)
            assert empty.startswith("BatchError - True Compiled.step: the global batch is "
                                    "empty"), (rank, name, empty)
            assert after == "finite True", (rank, name, after)
        for name in TRAINING_PASSES:   # rank 1's global batch differs in inputs[0]
            seen, kept, finite = out[rank][f"batch {name}"]
            assert seen.startswith("BatchError global_batch (global batches): inputs[0] "
                                   "differs across ranks (ranks [0]:"), (rank, name, seen)
            assert "ranks [1]:" in seen, (rank, name, seen)
            # before any update; tick_tock's loss all-reduce (it rides on) comes after its
            # waves' updates
            assert (kept or name == "tick_tock") and finite, (rank, name, kept, finite)
        assert out[rank]["gathers"] == [], (rank, out[rank]["gathers"])
