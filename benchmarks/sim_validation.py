"""Simulator vs measurement on every plan kind: the composition error and the end-to-end error,
reported apart.

* **Composition** (``tidal.sim.composition``): each plan kind (data parallel, compression,
  burst, tick_tock, round_robin, layer groups, a data-parallel foreground with a background
  job) runs on 2 and 4 gloo ranks (1 thread each; ``benchmarks/sim_runs.py``) with the tiny
  MLP, two plain ``torch.nn`` models of the third-party matrix and two in-repo BatchNorm
  CNNs. Per traced step (a repeat), the simulator runs the very Program objects the executor
  ran, given each piece's measured
  own duration, the ranks' releases and each piece's measured dispatch gap
  (``compose(..., release=True, gaps=True)``): this *replay* checks that the model of
  streams, links, dependencies and joined collectives reproduces the trace (near 0 by
  construction: no accuracy figure). The *composition error* models host dispatch instead
  of reading it: each piece gets the mean gap of its class (its stream, and whether it
  waits for another stream: ``sim.composition.dispatch_model``), calibrated on the run's
  other repeats, in place of its own (the ``composition`` column; the goals apply to it).
  Each row: the median over repeats of the measured step, the replayed step and its error,
  with the spread (min..max), the composition error, and where the composed timeline first
  departs from the measured one (``departure``, for the repeat of median error: the piece,
  by how much, after what, and its measured dispatch gap).
* **End-to-end** (``benchmarks/sim_end_to_end.py``): the cluster simulator given the
  profiler's per-layer durations, calibrated on the ranks in the same rounds as the measured
  steps, gloo links fitted in those rounds (after the step's computation, in a loop whose
  next step follows each all-reduce or with nothing after; and inside the computation:
  ``sim.engine.simulate(link_load=)``) and two host terms of tidal's runtime calibrated on the
  composition runs of the burst kind (dispatch per piece, ``Compiled.step``'s host time
  outside its pieces: :func:`burst_host_us`), against DDP data parallelism and a hand-written
  burst plan run through tidal (``--e2e-models``), each measured as a training loop's period.

The summary gives the composition median and max |error|, the end-to-end median |error| and
the mean (signed) error per plan kind, against issue 36's goals (composition median <= 5 %,
max <= 10 %; end-to-end median <= 10 %; no kind biased by more than 5 % on average). The
machine's load average is printed at start and end; other processes are not modelled, and
ranks beyond the cores share them (said when so).

    python benchmarks/sim_validation.py --quick          # 2 ranks, the MLP, 5 repeats, no e2e
    python benchmarks/sim_validation.py [--ranks 2,4] [--models mlp,nn_mha,nn_transformer]
        [--kinds burst,tick_tock] [--repeats 9] [--e2e-models vgg16_small] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import sim_end_to_end  # noqa: E402
from benchmarks.sim_runs import KINDS, WORKLOADS, run  # noqa: E402
from tidal.sim.composition import (compose, departure, dispatch_means,  # noqa: E402
                                   dispatch_model, measured_pieces, measured_step_us,
                                   step_us)

DISTURBED = 1.5
"""A traced step longer than this many times its run's median step was disturbed from
outside (the machine's other processes): its gaps do not calibrate the dispatch model."""
GOALS = {"composition median": 0.05, "composition max": 0.10, "end-to-end median": 0.10,
         "bias per kind": 0.05}


@dataclass(frozen=True)
class Row:
    """One row: model, ranks, plan kind (``label``: the plan as shown), per repeat the
    measured and composed step (us; composed empty for an end-to-end row), the end-to-end
    prediction (us, None where none exists) and the first departure."""

    model: str
    ranks: int
    kind: str
    label: str
    measured_us: tuple
    composed_us: tuple = ()
    e2e_us: Optional[float] = None
    departure: str = ""
    modelled_us: tuple = ()
    mean_gap_us: float = 0.0
    outside_us: float = 0.0

    @property
    def errors(self) -> list[float]:
        """The replay error of each repeat, (replayed - measured) / measured."""
        return [(c - m) / m for c, m in zip(self.composed_us, self.measured_us)]

    @property
    def error(self) -> Optional[float]:
        """The median replay error over repeats (None: no composition run)."""
        return statistics.median(self.errors) if self.composed_us else None

    @property
    def composition_error(self) -> Optional[float]:
        """The composition error: the median error over repeats of the composition with host
        dispatch modelled, the mean measured gap of each piece's class on the other repeats
        in place of each piece's own gap."""
        if not self.modelled_us:
            return None
        return statistics.median((c - m) / m for c, m in zip(self.modelled_us,
                                                              self.measured_us))

    @property
    def e2e_error(self) -> Optional[float]:
        """The end-to-end error against the median measured step (None: no prediction)."""
        if self.e2e_us is None:
            return None
        m = statistics.median(self.measured_us)
        return (self.e2e_us - m) / m


def composition_row(model: str, world: int, kind: str, run_of_kind, tolerance: float) -> Row:
    """The row of one kind's run (``sim_runs.KindRun``): per repeat, the measured step, the
    replay (``compose(release=True, gaps=True)``: each piece's own gap) and the composition
    with host dispatch modelled: each piece delayed by the mean gap of its class calibrated
    on the run's *other* repeats (``dispatch_means``; on the repeat itself when there is no
    other), so no step is predicted from its own gaps. A repeat more than ``DISTURBED`` times
    the run's median step is left out of the calibration (still predicted): its gaps are
    another process's hold on the cores, which the model leaves out (one such step among 5
    put its stalls in every other repeat's prediction: rows over-predicted by 14-16 %). The
    departure is the composition's, for the repeat of median composition error, within
    ``tolerance`` of the measured step."""
    programs = run_of_kind.programs
    per_repeat = [measured_pieces(programs, traces, False) for traces in run_of_kind.traces]
    steps = [measured_step_us(traces) for traces in run_of_kind.traces]
    calm = [j for j, us in enumerate(steps) if us <= DISTURBED * statistics.median(steps)]
    measured, composed, modelled, intervals = [], [], [], []
    for i, traces in enumerate(run_of_kind.traces):
        others = [m for j in calm if j != i for m in per_repeat[j]] or per_repeat[i]
        delays = dispatch_model(programs, per_repeat[i], dispatch_means(programs, others))
        sim = compose(programs, traces, delays=delays, release=True)
        measured.append(steps[i])
        composed.append(step_us(compose(programs, traces, release=True, gaps=True)))
        modelled.append(step_us(sim))
        intervals.append(sim)
    errors = [(c - m) / m for c, m in zip(modelled, measured)]
    median_at = sorted(range(len(errors)), key=errors.__getitem__)[len(errors) // 2]
    first = departure(programs, run_of_kind.traces[median_at], intervals[median_at],
                      tolerance * measured[median_at])
    gaps = [m.gap_us for ms in per_repeat for m in ms]
    return Row(model, world, kind, kind, tuple(measured), tuple(composed), None,
               str(first) if first else "none: every piece starts within "
               f"{tolerance:.0%} of the step", tuple(modelled), statistics.fmean(gaps),
               statistics.fmean(run_of_kind.outside_us) if run_of_kind.outside_us else 0.0)


def _spread(values, scale: float = 1e-3, fmt: str = "{:.2f}") -> str:
    """``median (min..max)`` of ``values`` times ``scale``."""
    v = [x * scale for x in values]
    return (fmt.format(statistics.median(v)) + " (" + fmt.format(min(v)) + ".."
            + fmt.format(max(v)) + ")")


def print_rows(rows: list[Row]) -> None:
    """The table: measured and composed ms, composition and end-to-end error, apart; each
    composition row followed by its first departure."""
    print(f"\n{'model':15s} {'ranks':>5s} {'plan':30s} {'measured ms':>22s} "
          f"{'composed / e2e ms':>22s} {'replay':>24s} {'end-to-end':>10s} "
          f"{'composition':>14s}")
    for r in rows:
        predicted = (_spread(r.composed_us) if r.composed_us else f"{r.e2e_us / 1e3:.2f}")
        comp = (_spread(r.errors, 100.0, "{:+.1f}") + " %") if r.composed_us else "-"
        e2e = f"{r.e2e_error:+.1%}" if r.e2e_error is not None else "-"
        const = f"{r.composition_error:+.1%}" if r.composition_error is not None else "-"
        print(f"{r.model:15s} {r.ranks:5d} {r.label[:30]:30s} {_spread(r.measured_us):>22s} "
              f"{predicted:>22s} {comp:>24s} {e2e:>10s} {const:>14s}")
        if r.departure:
            print(f"    first departure: {r.departure}")


def summary(rows: list[Row]) -> list[str]:
    """The lines of the summary issue 36's done-means names, each against its goal. The
    composition error is the one with host dispatch MODELLED (per piece class, the
    ``composition`` column); the replay (each piece's own measured gap and each rank's side
    of a collective, the ``replay`` column) only checks that the simulator's streams,
    dependencies and joined collectives reproduce the trace: it is near 0 by construction
    and is no accuracy figure."""
    replay = [abs(r.error) for r in rows if r.error is not None]
    comp = [abs(r.composition_error) for r in rows if r.composition_error is not None]
    e2e = [abs(r.e2e_error) for r in rows if r.e2e_error is not None]

    def verdict(value: float, goal: str) -> str:
        return f"{value:.1%} (goal <= {GOALS[goal]:.0%}: " + (
            "met)" if value <= GOALS[goal] else "NOT met)")

    lines = []
    if replay:
        lines.append(f"replay of the traces (each piece's own gap and sides; no accuracy "
                     f"figure): median |error| {statistics.median(replay):.1%}, max "
                     f"{max(replay):.1%} over {len(replay)} rows")
    if comp:
        med = verdict(statistics.median(comp), "composition median")
        lines += [f"composition median |error| (host dispatch modelled: the mean gap of each "
                  f"piece's class on the other repeats): {med} over {len(comp)} rows",
                  f"composition max |error|: {verdict(max(comp), 'composition max')}"]
    if e2e:
        med = verdict(statistics.median(e2e), "end-to-end median")
        lines.append(f"end-to-end median |error|: {med} over {len(e2e)} rows")
    for kind in dict.fromkeys(r.kind for r in rows):
        of = [r for r in rows if r.kind == kind]
        parts = []
        for what, errs in (("composition", [r.composition_error for r in of
                                            if r.composition_error is not None]),
                           ("end-to-end", [r.e2e_error for r in of if r.e2e_error is not None])):
            if errs:
                bias = statistics.mean(errs)
                parts.append(f"{what} {bias:+.1%} over {len(errs)} row(s)"
                             + ("" if abs(bias) <= GOALS["bias per kind"] else " (biased)"))
        lines.append(f"mean error of {kind}: " + "; ".join(parts))
    return lines


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def composition_rows(args, worlds, cores: int) -> list[Row]:
    """Every (ranks, model, kind) row of the composition check, one spawned job per ranks and
    model."""
    rows = []
    for world in worlds:
        if world > cores:
            print(f"note: {world} ranks on {cores} cores: the ranks share cores (their "
                  "measured own durations include the sharing; the composition does not model "
                  "it apart)")
        for model in args.models.split(","):
            with tempfile.TemporaryDirectory() as folder:
                ran = run(world, model, args.batch, Path(folder), args.kinds.split(","),
                          args.repeats)
            for kind, run_of_kind in ran.items():
                rows.append(composition_row(model, world, kind, run_of_kind, args.tolerance))
                print(f"{model} on {world} ranks, {kind}: composition error "
                      f"{rows[-1].composition_error:+.1%} (replay {rows[-1].error:+.1%})",
                      flush=True)
    return rows


def burst_host_us(rows: list[Row]) -> tuple[dict[int, float], dict[int, float]]:
    """Per world size, two host terms of tidal's burst runs among the composition rows
    (every model and repeat), calibrated on other runs than the end-to-end ones they serve:
    the mean dispatch gap per piece (added per runtime piece,
    ``sim.programs.burst_execution(dispatch_us=)``) and ``Compiled.step``'s mean host time
    outside its pieces (binding the batch, its checks; added to the step)."""
    gaps: dict[int, list[float]] = {}
    outside: dict[int, list[float]] = {}
    for r in rows:
        if r.kind == "burst" and r.composed_us:
            gaps.setdefault(r.ranks, []).append(r.mean_gap_us)
            outside.setdefault(r.ranks, []).append(r.outside_us)
    return ({w: statistics.fmean(v) for w, v in gaps.items()},
            {w: statistics.fmean(v) for w, v in outside.items()})


def end_to_end(args, worlds, cores: int, dispatch_us: dict[int, float],
               outside_us: dict[int, float]) -> list[Row]:
    """The end-to-end rows (``sim_end_to_end``) as table rows."""
    out = []
    for name, w, label, predicted, measured in sim_end_to_end.end_to_end_rows(
            args, cores, worlds, dispatch_us, outside_us):
        out.append(Row(name, w, "burst" if label.startswith("burst") else label, label,
                       (measured,), (), predicted))
    return out


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 ranks, the tiny MLP, 5 repeats, no end-to-end rows (under a "
                             "minute)")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--models", default=",".join(WORKLOADS),
                        help=f"composition models, of {sorted(WORKLOADS)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"plan kinds, of {KINDS}")
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch of the composition runs (tick_tock on N ranks "
                             "needs 2N shards)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="traced steps per kind (after 2 warm-up steps; default 9: with 5, "
                             "rows whose steps spread 2-3x on this shared 2-core machine missed "
                             "by 11-16 %%)")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="a piece departs when its composed start is off by more than "
                             "this fraction of the measured step")
    sim_end_to_end.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.models, args.repeats, args.e2e_models = "2", "mlp", 5, ""
    return args


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    cores, worlds = _cores(), tuple(int(w) for w in args.ranks.split(","))
    print(f"{cores} cores; load average at start {os.getloadavg()[0]:.1f} (other processes "
          "are not modelled: compare on a quiet machine)", flush=True)
    rows = composition_rows(args, worlds, cores)
    if args.e2e_models:
        dispatch, outside = burst_host_us(rows)
        missing = [w for w in worlds if w not in dispatch]
        if missing:
            print(f"note: no composition run of the burst kind on {missing} ranks: the "
                  "end-to-end burst rows there model no host dispatch or host time outside "
                  "the pieces")
        rows += end_to_end(args, worlds, cores, dispatch, outside)
    print_rows(rows)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (1 min), "
          f"{os.getloadavg()[1]:.1f} (5 min)")
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
