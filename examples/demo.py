"""The main job: compile every in-repo example model with every pass that applies, print the
per-pass report, and write the visualization dump.

    python examples/demo.py --out tidal-out [--models resnet50_small,bert_small] [--gpus 4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import SMALL_MODELS, ZOO  # noqa: E402
from tidal.compiler.viz import DumpSection, write_index  # noqa: E402


def demo_cluster(gpus: int) -> tidal.Cluster:
    """The machine the demo plans for: ``gpus`` devices about as fast as this CPU (20 GFLOP/s)
    on 10 Gb/s links with 50 us latency, so the small zoo models have plans worth showing."""
    return tidal.Cluster(gpus=gpus, bandwidth_gbps=10, latency_us=50, peak_tflops=0.02)


def run_model(name: str, gpus: int, batch: int, out: Path, passes="auto",
              label: str = "") -> DumpSection:
    """Compile one zoo model with ``passes`` (default: every pass that applies), print its
    report, run one training step and dump it."""
    torch.manual_seed(0)
    model = ZOO[name]()
    inputs, targets = model.example_inputs(batch), model.example_targets(batch)
    compiled = tidal.compile(
        model, inputs, passes=passes, cluster=demo_cluster(gpus),
        loss_fn=model.default_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        example_targets=targets)
    name = f"{name}{label}"
    print(f"\n=== {name} (batch {batch}, {gpus} GPUs planned) ===")
    print(compiled.report())
    for record in compiled.records:
        if record.plan is not None:
            print(f"-- {record.name} plan --\n{record.plan.table()}")
    loss = compiled.step(inputs, targets)
    print(f"one training step: loss {loss.item():.4f}")
    index = compiled.dump(out / name)
    print(f"dump: {index}")
    passes = [r.name for r in compiled.records]
    return DumpSection(name=name, summary_rows=(("passes", " -> ".join(passes)),
                                                ("loss after one step", f"{loss.item():.4f}")),
                       files=(Path(name) / "index.html",), text=compiled.report())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tidal-out", help="dump directory (default tidal-out)")
    parser.add_argument("--models", default=",".join(SMALL_MODELS),
                        help="comma-separated zoo models (default: the small ones)")
    parser.add_argument("--gpus", type=int, default=4, help="GPUs to plan for (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; zoo: {', '.join(sorted(ZOO))}")
    out = Path(args.out)
    print(f"registered passes: {', '.join(tidal.passes.registry()) or 'none yet'}")
    print(f"planning for: {demo_cluster(args.gpus)}")
    sections = [run_model(n, args.gpus, args.batch, out) for n in names]
    # passes="auto" keeps one pass of each group of alternatives (e.g. one way to parallelize
    # the step); show the others on the first model
    alternatives = [cls.name for cls in tidal.passes.registry().values() if cls.exclusive]
    for alt in alternatives[1:]:
        sections.append(run_model(names[0], args.gpus, args.batch, out, passes=[alt],
                                  label=f"-{alt}"))
    index = write_index(out, "tidal demo", sections)
    print(f"\nall dumps: {index}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
