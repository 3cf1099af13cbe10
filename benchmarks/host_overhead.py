"""The runtime's host-overhead figures (issue 33, item 5) and how they are measured.

Three figures, each printed against its goal by ``benchmarks/overlap.py`` (the first) and
``benchmarks/replay_overhead.py`` (the other two; ``--ddp`` adds the first, so one run prints
all three):

- the data-parallel program with overlap against PyTorch DDP on 2 gloo ranks
  (:data:`GOAL_DP_VS_DDP`);
- a batch-1 training step through the program against eager PyTorch
  (:data:`GOAL_STEP_VS_EAGER`);
- the host time per piece dispatched (:data:`GOAL_US_PER_PIECE`): a program of trivial pieces
  run through ``ProgramRunner.launch`` (the scheduler's dispatch loop, the backend's streams,
  events and launches), its time divided by its pieces (:func:`us_per_piece`).

Every figure is a median of interleaved repeats (the variants alternate, so the noise of a
shared machine hits them alike), printed with the load average (:func:`load_note`) and, beside
the wall time, the process's CPU time, which counts the host work done whether or not the
machine's other load kept the process waiting for a core.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Mapping

from tidal.ir.program import COMM, COMPUTE, Piece, Program, data_parallel_program

GOAL_DP_VS_DDP = 1.05
"""Data-parallel program with overlap / PyTorch DDP, 2 gloo ranks: at most this."""
GOAL_STEP_VS_EAGER = 1.03
"""Batch-1 training step through the program / eager PyTorch: at most this."""
GOAL_US_PER_PIECE = 20.0
"""Host µs per piece dispatched: at most this."""


def load_note() -> str:
    """The load average and CPU count, and that the machine may be shared.

    Example:
        >>> load_note().startswith("load average")
        True
    """
    one, five, fifteen = os.getloadavg()
    return (f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min) on "
            f"{os.cpu_count()} CPUs: a shared machine, other work may run beside this one; "
            f"figures are medians of interleaved repeats")


def goal_line(what: str, value: float, goal: float, unit: str = "x") -> str:
    """``what``: ``value`` against ``goal`` (at most), and whether it is met.

    Example:
        >>> goal_line("program / eager", 1.012, 1.03)
        'program / eager: 1.012x (goal <= 1.03x: met)'
        >>> goal_line("host per piece", 31.5, 20.0, " us")
        'host per piece: 31.5 us (goal <= 20.0 us: not met)'
    """
    shown = f"{value:.3f}" if unit == "x" else f"{value:.1f}"
    verdict = "met" if value <= goal else "not met"
    return f"{what}: {shown}{unit} (goal <= {goal}{unit}: {verdict})"


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int
                ) -> dict[str, tuple[float, float]]:
    """Run each of ``fns`` once per round, ``repeats`` rounds, the order rotated by one each
    round (each follows each other alike: what one leaves in the caches or the allocator
    does not always fall on the same next one); by name, the median wall time and the median
    CPU time of the process (all its threads) per call, in seconds.

    Example:
        >>> med = interleaved({"a": lambda: sum(range(100))}, repeats=3)
        >>> sorted(med), all(t >= 0 for t in med["a"])
        (['a'], True)
    """
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def trivial_programs(units: int = 50) -> dict[str, Program]:
    """Programs of pieces that do nothing, to time the dispatch alone: ``data-parallel``, the
    shape a data-parallel step has (``units`` segments on the compute stream, each followed by
    the all-reduce of its bucket on the comm stream, then the optimizer after all: events and
    hand-offs between streams), and ``compute chain``, as many pieces on the compute stream
    only (the dispatcher's own work and the backend's launches).

    Example:
        >>> {k: len(p.pieces) for k, p in trivial_programs(3).items()}
        {'data-parallel': 7, 'compute chain': 7}
    """
    dp = data_parallel_program([f"unit {i}" for i in range(units)],
                               [(i, 4.0, units - 1 - i) for i in range(units)], world=2,
                               bucket_bytes=4)
    n = len(dp.pieces)
    chain = Program(tuple(Piece(f"piece {i}", COMPUTE, (i - 1,) if i else ())
                          for i in range(n)))
    return {"data-parallel": dp, "compute chain": chain}


def us_per_piece(repeats: int = 30, units: int = 50, runner=None
                 ) -> dict[str, tuple[float, float]]:
    """Host µs per piece dispatched (wall, CPU) for each of :func:`trivial_programs`, run
    through ``ProgramRunner.launch`` (``runner``, a new CPU one by default; its streams are
    made before the timed runs), interleaved, medians.

    Example:
        >>> sorted(us_per_piece(repeats=1, units=2))
        ['compute chain', 'data-parallel']
    """
    from tidal.runtime.backend import OnCaller
    from tidal.runtime.program import ProgramRunner

    own = runner is None
    runner = ProgramRunner() if own else runner
    programs = trivial_programs(units)

    def work(index: int, piece: Piece) -> Callable[[], None]:
        # as the data-parallel programs bind them: a sync piece only issues its all-reduce
        # (async), so it runs on the dispatching thread (OnCaller), not on a stream worker
        return OnCaller(lambda: None) if piece.stream == COMM else (lambda: None)

    try:
        for p in programs.values():
            runner.launch(p, work)
        med = interleaved({k: (lambda p=p: runner.launch(p, work)) for k, p in
                           programs.items()}, repeats)
    finally:
        if own:
            runner.close()
    return {k: (wall / len(programs[k].pieces) * 1e6, cpu / len(programs[k].pieces) * 1e6)
            for k, (wall, cpu) in med.items()}
