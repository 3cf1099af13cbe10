"""Training jobs submitted to the scheduler: a compiled model's program as the foreground, a
second model as a background job; each trains exactly as its own ``Compiled.step`` loop."""
import copy

import torch
import torch.nn.functional as F

import tidal
from tidal.runtime.backend import CpuBackend
from tidal.runtime.scheduler import Runtime


def _compiled(model, passes):
    return tidal.compile(model, (torch.randn(8, 6),), passes=passes, loss_fn=F.cross_entropy,
                         cluster=tidal.Cluster(gpus=2),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _batches(seed):
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(4)]
    return lambda i: data[i % len(data)]


def test_a_program_job_and_a_background_job_train_as_their_own_steps():
    torch.manual_seed(0)
    fg_model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    bg_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fg_ref, bg_ref = copy.deepcopy(fg_model), copy.deepcopy(bg_model)
    fg, bg = _compiled(fg_model, ["burst_parallel"]), _compiled(bg_model, [])
    fg_batches, bg_batches = _batches(1), _batches(2)
    with Runtime(backend=CpuBackend(slots=1)) as rt:
        fg_job = rt.submit(fg.job(fg_batches, iterations=3), priority="high")
        bg_job = rt.submit(bg.job(bg_batches, name="extra", iterations=2), priority="low")
        stats = rt.run(until="all")
    assert stats["train"].iterations == 3 and stats["train"].error is None
    assert stats["extra"].iterations == 2 and stats["extra"].error is None
    assert {r.stream for r in rt.trace if r.job == "train"} >= {"compute"}
    fg_c, bg_c = _compiled(fg_ref, ["burst_parallel"]), _compiled(bg_ref, [])
    expected = [float(fg_c.step(*fg_batches(i))) for i in range(3)]
    torch.testing.assert_close(torch.stack(fg_job.job.losses), torch.tensor(expected),
                               rtol=1e-5, atol=1e-6)
    expected_bg = [float(bg_c.step(*bg_batches(i))) for i in range(2)]
    torch.testing.assert_close(torch.stack(bg_job.job.losses), torch.tensor(expected_bg),
                               rtol=1e-5, atol=1e-6)


def test_a_program_job_builds_a_step_once_the_previous_one_ended():
    """Binding step i reads what step i-1 left (and may run a collective): the scheduler asks
    for it only after step i-1's last piece, though it refills queues early otherwise."""
    import time

    from tidal.runtime.program import COMPUTE, Piece, ProgramJob
    from tidal.runtime.scheduler import BoundPiece

    seen = []

    def make(i):
        seen.append(len(job.losses))
        return ([BoundPiece(Piece("work", COMPUTE), lambda: time.sleep(0.01))],
                lambda: torch.tensor(float(i)))

    job = ProgramJob("train", make, iterations=3)
    with Runtime(backend=CpuBackend(slots=None)) as rt:
        rt.submit(job, priority="high")
        rt.run()
    assert seen == [0, 1, 2] and [float(l) for l in job.losses] == [0.0, 1.0, 2.0]


def test_the_report_names_what_a_step_ran_uncaptured():
    """Data parallelism (compression off) lowers the joint graph: a buffer written in place in
    forward runs uncaptured, and the report names its node after the first step."""
    from tidal.passes.compression import CompressionPass

    from counting import Counting

    c = _compiled(Counting(6, 3), [CompressionPass(mode="off")])
    assert "runs uncaptured" not in c.report()
    c.step(*_batches(3)(0))
    line = next(l for l in c.report().splitlines() if "runs uncaptured" in l)
    assert "runtime:" in line and "add_" in line and "in-place update" in line
    assert float(c.model.seen) == 8.0


def _bind_in_opposite_orders(rank, size):
    """Two data-parallel jobs on 2 ranks, check_batch on: after a step of each (the same order
    on both ranks: the programs are bound and captured), the next iterations are bound in
    opposite orders on the two ranks, as a scheduler's binding thread may; then run in the
    same order. Rank 1's second background batch differs from rank 0's. Returns the jobs'
    losses and the error each second background iteration raised."""
    from tidal.passes.compression import CompressionPass
    from tidal.runtime.batch_data import BatchError

    torch.manual_seed(0)
    fg = _compiled(torch.nn.Linear(6, 3), [CompressionPass(mode="off")])
    bg = _compiled(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(),
                                       torch.nn.Linear(4, 3)), [CompressionPass(mode="off")])
    fg_batches, bg_batches = _batches(1), _batches(2)
    odd = _batches(3)
    fg.step(*fg_batches(0))
    bg.step(*bg_batches(0))
    fg_job = fg.job(fg_batches)
    bg_job = bg.job(lambda i: odd(i) if rank == 1 and i == 2 else bg_batches(i), name="extra")
    jobs = [fg_job, bg_job] if rank == 0 else [bg_job, fg_job]
    bound = {id(job): job.iteration(1) for job in jobs}   # no collective while binding
    errors = []
    for job in (fg_job, bg_job):
        for piece in bound[id(job)]:
            piece.fn()
    try:
        for piece in bg_job.iteration(2):
            piece.fn()
    except BatchError as e:
        errors.append(str(e))
    return [float(x) for x in fg_job.losses], [float(x) for x in bg_job.losses], errors


def test_jobs_bound_in_different_orders_on_two_ranks_do_not_wait_for_each_other():
    """``Compiled.job``'s global-batch check rides on the step's loss all-reduce (no exchange
    while binding: a blocking one in each job, bound in opposite orders on the two ranks, had
    each rank wait in another job's exchange until the process group's timeout), and it still
    catches ranks whose batches differ."""
    from tidal.runtime.distributed import spawn

    ranks = spawn(_bind_in_opposite_orders, 2, pg_timeout_s=20, timeout_s=180)
    (fg0, bg0, err0), (fg1, bg1, err1) = ranks
    assert len(fg0) == 1 and fg0 == fg1 and len(bg0) == 1 and bg0 == bg1
    assert len(err0) == len(err1) == 1 and "batch" in err0[0], (err0, err1)
