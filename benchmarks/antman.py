"""AntMan's cluster scheduler on a simulated cluster trace, against a dedicated-GPU baseline.

Everything here is simulated (``tidal.sim.antman_cluster``, ``tidal.sim.antman_trace``): a
seeded synthetic trace shaped like the slides' production observations runs on ``--nodes`` x
``--gpus-per-node`` model GPUs (32 GB) four ways, in one process:

* dedicated: no opportunistic sharing, every job waits for whole GPUs (the baseline);
* AntMan: Algorithm 1, the local coordinator (idle compute share, memory capped with host
  spill) and job upgrade;
* AntMan without job upgrade;
* guaranteed jobs alone: the trace without its opportunistic jobs (the interference-free
  reference for guaranteed jobs).

Printed: GPU utilization (busy GPU-time / GPU-time; and over the GPU-time of GPUs holding a job,
the slides' "utilization of in-use GPUs"), guaranteed-job JCT and queueing delay (mean,
p90), all jobs' queueing delay, their ratios to the baseline, how many guaranteed jobs ran with
zero interference, and beside them the slides' production figures; then the slides' Table 1/2
two-job example run in the simulator, our JCTs beside theirs. The last line is the ratio against
the dedicated baseline.

    python benchmarks/antman.py [--nodes 4] [--gpus-per-node 8] [--jobs 400] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tidal.ir.table import format_table  # noqa: E402
from tidal.sim.antman_trace import (GPU_MEMORY_GB, TABLE2, RunResult, run,  # noqa: E402
                                    synthetic_trace, table2_jobs)

SLIDES_QUEUE_S = {"Dec. 2019": (1132, 1978, 5960), "Apr. 2020": (550, 124, 489)}
"""Table 4: one week's queueing delay (avg, p90, p95 seconds) before and after AntMan."""
SLIDES_ZERO_INTERFERENCE = (9895, 10000)
"""Table 5: jobs with 0 % mini-batch interference, of the 10K production jobs analysed."""


def _row(name: str, r: RunResult) -> list[str]:
    g, every = r.stats(True), r.stats(None)
    return [name, f"{r.utilization:.3f}", f"{r.in_use_utilization:.3f}",
            f"{r.makespan_s / 3600:.1f}",
            f"{g['jct_mean'] / 60:.1f}", f"{g['jct_p90'] / 60:.1f}",
            f"{g['queue_mean'] / 60:.1f}", f"{g['queue_p90'] / 60:.1f}",
            f"{every['queue_mean'] / 60:.1f}"]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def trace_section(args: argparse.Namespace) -> tuple[RunResult, RunResult]:
    jobs = synthetic_trace(args.jobs, args.nodes, args.gpus_per_node, args.seed,
                           load=args.load, opportunistic=args.opportunistic)
    opts = dict(interference=args.interference, spill_penalty=args.spill_penalty)
    shape = (args.nodes, args.gpus_per_node)
    dedicated = run(jobs, *shape, sharing=False)
    antman = run(jobs, *shape, **opts)
    no_upgrade = run(jobs, *shape, upgrade=False, **opts)
    alone = run([j for j in jobs if j.guaranteed], *shape)
    n_g = sum(j.guaranteed for j in jobs)
    print(f"SIMULATED cluster trace: {args.nodes} nodes x {args.gpus_per_node} GPUs "
          f"({GPU_MEMORY_GB:.0f} GB), {args.jobs} jobs ({n_g} guaranteed, {args.jobs - n_g} "
          f"opportunistic), seed {args.seed}, offered load {args.load}, interference "
          f"{args.interference:.0%} while sharing, host-spill penalty {args.spill_penalty}")
    header = ["run (simulated)", "GPU util", "in-use util", "makespan h", "G JCT mean", "G JCT p90",
              "G queue mean", "G queue p90", "all queue mean"]
    print("times in minutes; G = guaranteed jobs (as submitted)")
    print(format_table(header, [_row("dedicated GPUs (baseline)", dedicated),
                                _row("AntMan", antman),
                                _row("AntMan, no job upgrade", no_upgrade),
                                _row("guaranteed jobs alone", alone)]))
    print()
    base_g, base_all = dedicated.stats(True), dedicated.stats(None)
    rows = []
    for name, r in (("AntMan", antman), ("AntMan, no job upgrade", no_upgrade)):
        s, every = r.stats(True), r.stats(None)
        rows.append([name, _ratio(r.utilization, dedicated.utilization),
                     _ratio(r.in_use_utilization, dedicated.in_use_utilization),
                     _ratio(s["jct_mean"], base_g["jct_mean"]),
                     _ratio(s["jct_p90"], base_g["jct_p90"]),
                     _ratio(s["queue_mean"], base_g["queue_mean"]),
                     _ratio(every["queue_mean"], base_all["queue_mean"]),
                     _ratio(s["jct_mean"], alone.stats()["jct_mean"])])
    print(format_table(["vs dedicated (simulated)", "GPU util", "in-use util", "G JCT mean",
                        "G JCT p90", "G queue mean", "all queue mean", "G JCT vs alone"], rows))
    g_recs = antman.select(True)
    clean = sum(not r.shared for r in g_recs)
    upgraded = sum(r.upgraded_s is not None for r in antman.records)
    spilled = [r.spilled_gb for r in antman.records if r.spilled_gb > 0]
    print(f"AntMan (simulated): {clean} of {len(g_recs)} guaranteed jobs "
          f"({clean / len(g_recs):.1%}) never shared a GPU (zero interference; the others ran "
          f"{args.interference:.0%} slower while sharing); {upgraded} opportunistic jobs "
          f"upgraded; {len(spilled)} spilled memory to host (most "
          f"{max(spilled, default=0.0):.2f} GB)")
    before, after = SLIDES_QUEUE_S["Dec. 2019"], SLIDES_QUEUE_S["Apr. 2020"]
    ok, total = SLIDES_ZERO_INTERFERENCE
    print(f"slides (production, Alibaba): queueing delay avg {before[0]} s -> {after[0]} s "
          f"({after[0] / before[0]:.2f}x, 'reduced by 2x on average'), p90 {before[1]} -> "
          f"{after[1]} s, p95 {before[2]} -> {after[2]} s; {ok} of {total} jobs "
          f"({ok / total:.1%}) with 0 % interference; 42 % better GPU memory utilization")
    return dedicated, antman


def table2_section(args: argparse.Namespace) -> None:
    jobs = table2_jobs(args.gcn_share, args.resnet_share)
    fifo = {r.name: r.jct_s / 60 for r in run(jobs, 1, 1, sharing=False).records}
    am_run = run(jobs, 1, 1, upgrade=False, interference=args.interference,
                 spill_penalty=args.spill_penalty)
    antman = {r.name: r.jct_s / 60 for r in am_run.records}
    print()
    print(f"Slides' Table 1/2 on one SIMULATED {GPU_MEMORY_GB:.0f} GB GPU: Job-A GCN "
          f"opportunistic 3.5 GB at 0 min (43.0 min alone), Job-B ResNet guaranteed 30 GB at "
          f"26 min (91.1 min alone); assumed compute shares GCN {args.gcn_share}, ResNet "
          f"{args.resnet_share}; Job-A has no quota, so it is not upgraded")
    rows = []
    for config in ("Preempt", "FIFO", "Pack", "UMem", "AntMan"):
        ours = {"FIFO": fifo, "AntMan": antman}.get(config)
        theirs = [TABLE2[j][config] for j in ("Job-A", "Job-B")]
        rows.append([config, *(f"{ours[j]:.1f}" if ours else "not modelled"
                               for j in ("Job-A", "Job-B")),
                     *("Failed" if t is None else f"{t:.1f}" for t in theirs)])
    print(format_table(["JCT min", "Job-A ours (sim)", "Job-B ours (sim)", "Job-A slides",
                        "Job-B slides"], rows))
    print(f"ours: FIFO is the dedicated baseline; AntMan caps Job-A at "
          f"{GPU_MEMORY_GB - 30:.1f} GB on the GPU once Job-B arrives "
          f"({am_run.records[0].spilled_gb:.1f} GB to host)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=float, default=1.3,
                   help="requested GPU-time over the arrival period / cluster GPU-time")
    p.add_argument("--opportunistic", type=float, default=0.3,
                   help="fraction of jobs submitted opportunistic (no quota)")
    p.add_argument("--interference", type=float, default=0.01,
                   help="guaranteed job's slowdown while it shares a GPU (fraction)")
    p.add_argument("--spill-penalty", type=float, default=1.0,
                   help="slowdown per fraction of a job's memory in host memory")
    p.add_argument("--gcn-share", type=float, default=0.4)
    p.add_argument("--resnet-share", type=float, default=0.6)
    args = p.parse_args(argv)
    dedicated, antman = trace_section(args)
    table2_section(args)
    d, a = dedicated.stats(), antman.stats()
    print()
    print(f"AntMan / dedicated GPUs (simulated, {args.jobs} jobs, seed {args.seed}): GPU "
          f"utilization {_ratio(antman.utilization, dedicated.utilization)} (in-use GPUs "
          f"{_ratio(antman.in_use_utilization, dedicated.in_use_utilization)}), guaranteed JCT "
          f"mean {_ratio(a['jct_mean'], d['jct_mean'])}, guaranteed queueing delay mean "
          f"{_ratio(a['queue_mean'], d['queue_mean'])} (slides, production: queueing 0.49x)")


if __name__ == "__main__":
    main()
