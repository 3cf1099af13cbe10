"""Per-step host overhead of the lowered (captured) form vs eager, on the CPU backend.

Models with many small ops at batch 1, where a step's time is almost all host-side dispatch:
a deep narrow MLP (200 Linear(16, 16) + GELU + LayerNorm blocks) and the zoo's llama_small and
bert_small. For each: the median forward time of eager ``model(x)``, of the fx graph module
``gm(x)`` (what ``Compiled`` runs today) and of ``lower(gm, x)(x)`` (one captured segment),
measured interleaved under ``torch.no_grad``; printed as ratios (lowered / eager: < 1 means less
host overhead per step). Then a whole training step at batch 1 (forward, loss, backward, SGD) of
the MLP: eager autograd against the captured joint graph (``tidal.capture_train_step``, the
graph the runtime's programs cut into segments) and the same step run as a program, as ratios.

Then the host-overhead figures of issue 33 (``benchmarks/host_overhead.py``), each against its
goal: the batch-1 training step through the program against eager, and the host time per piece
dispatched (trivial pieces through ``ProgramRunner.launch``); ``--ddp`` adds the data-parallel
program against PyTorch DDP on 2 gloo ranks (``benchmarks/overlap.py``), so one run prints all
three. Medians of interleaved repeats, wall time and the process's CPU time, with the load
average (the machine may be shared).

    python benchmarks/replay_overhead.py [--repeats 200] [--ddp]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from benchmarks.host_overhead import (GOAL_STEP_VS_EAGER, GOAL_US_PER_PIECE,  # noqa: E402
                                      goal_line, interleaved, load_note, us_per_piece)
from examples.models import ZOO  # noqa: E402
from tidal.ir.table import format_table  # noqa: E402
from tidal.runtime.lower import lower  # noqa: E402


class DeepNarrowMLP(torch.nn.Module):
    """Many tiny blocks: every op takes microseconds, so host dispatch dominates."""

    def __init__(self, blocks: int = 200, width: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
            for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def measure(name: str, model: torch.nn.Module, inputs: tuple, repeats: int) -> list:
    """Median µs per forward for eager, fx and lowered, and the ratios."""
    model.eval()
    gm = tidal.trace(model, inputs)
    lowered = lower(gm, inputs)
    fns = {"eager": lambda: model(*inputs), "fx": lambda: gm(*inputs),
           "lowered": lambda: lowered(*inputs)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        torch.testing.assert_close(lowered(*inputs), model(*inputs), rtol=0, atol=0)
        for fn in fns.values():
            fn()
        for _ in range(repeats):  # interleaved, so host noise hits all three alike
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    nodes = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
    return [name, nodes, round(med["eager"], 1), round(med["fx"], 1), round(med["lowered"], 1),
            round(med["lowered"] / med["eager"], 3), round(med["lowered"] / med["fx"], 3)]


def measure_step(model: torch.nn.Module, inputs: tuple, targets, loss_fn, repeats: int
                 ) -> tuple[int, dict[str, tuple[float, float]]]:
    """The captured step's aten ops, and by variant the median (wall, CPU) µs per training
    step (forward, loss, backward, SGD), interleaved: ``eager`` autograd; ``captured``, the
    joint graph (``tidal.capture_train_step``: one straight-line replay that returns the loss
    and every gradient, then the same SGD step); ``program``, the same step as a program
    (``tidal.runtime.program``: the joint graph lowered into captured segments, run as pieces
    through the scheduler's streams, the optimizer a piece of its own)."""
    from tidal.ir.capture import capture_train_step
    from tidal.runtime.program import ProgramRunner, data_parallel

    model.train()
    step = capture_train_step(model, inputs, targets, loss_fn)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model stays as it is

    def eager() -> None:
        opt.zero_grad()
        loss_fn(model(*inputs), targets).backward()
        opt.step()

    def captured() -> None:
        _, grads = step.run(model, inputs, targets)
        for k, g in grads.items():
            params[k].grad = g
        opt.step()

    program = data_parallel(step, world=1)
    with ProgramRunner() as runner:
        def as_program() -> None:
            runner(program, step, model, inputs, targets, opt)

        _, grads = step.run(model, inputs, targets)
        as_program()
        eager()
        for k, g in grads.items():
            torch.testing.assert_close(g, params[k].grad, rtol=1e-5, atol=1e-6)
        med = interleaved({"eager": eager, "captured": captured, "program": as_program},
                          repeats)
    nodes = sum(1 for n in step.gm.graph.nodes if n.op.startswith("call"))
    return nodes, {k: (wall * 1e6, cpu * 1e6) for k, (wall, cpu) in med.items()}


def step_rows(name: str, nodes: int, med: dict[str, tuple[float, float]]) -> list[list]:
    """Table rows (wall, then CPU) of :func:`measure_step`'s medians."""
    rows = []
    for col, clock in ((0, "wall"), (1, "CPU")):
        eager, captured, program = (med[k][col] for k in ("eager", "captured", "program"))
        rows.append([name, clock, nodes, round(eager, 1), round(captured, 1),
                     round(captured / eager, 3), round(program, 1), round(program / eager, 3)])
    return rows


def host_figures(step: dict[str, tuple[float, float]], repeats: int) -> list[str]:
    """The batch-1 step and per-piece figures against their goals (wall; CPU beside)."""
    eager, program = step["eager"], step["program"]
    lines = [goal_line("training step through the program / eager, batch 1 (wall)",
                       program[0] / eager[0], GOAL_STEP_VS_EAGER)
             + f"; CPU time {program[1] / eager[1]:.3f}x"]
    for shape, (wall, cpu) in us_per_piece(repeats).items():
        lines.append(goal_line(f"host time per piece dispatched, {shape} program (wall)",
                               wall, GOAL_US_PER_PIECE, " us") + f"; CPU time {cpu:.1f} us")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--ddp", action="store_true",
                        help="also the data-parallel program vs DDP on 2 gloo ranks")
    parser.add_argument("--ddp-steps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [measure("deep_narrow_mlp b1", DeepNarrowMLP(), (torch.randn(1, 16),), args.repeats)]
    for name in ("llama_small", "bert_small"):
        model = ZOO[name]()
        rows.append(measure(f"{name} b1", model, model.example_inputs(1), args.repeats // 2))
    print(format_table(["model", "ops", "eager us", "fx us", "lowered us", "lowered/eager",
                        "lowered/fx"], rows))
    mlp = DeepNarrowMLP()
    x, y = torch.randn(1, 16), torch.randn(1, 16)
    nodes, step = measure_step(mlp, (x,), y, torch.nn.functional.mse_loss, args.repeats // 2)
    print("\ntraining step (forward + backward + SGD), batch 1:")
    print(format_table(["model", "clock", "aten ops", "eager us", "captured us",
                        "captured/eager", "program us", "program/eager"],
                       step_rows("deep_narrow_mlp b1", nodes, step)))
    print(f"\nhost overhead (issue 33), {load_note()}:")
    for line in host_figures(step, max(args.repeats // 10, 5)):
        print("  " + line)
    if args.ddp:
        from benchmarks.overlap import ddp_figure

        print("  " + ddp_figure(args.ddp_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
