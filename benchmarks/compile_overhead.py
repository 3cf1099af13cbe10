"""Compile overhead and forward overhead of ``Compiled`` vs eager, in one process.

For ResNet-50 (batch 8, 224x224) and the decoder LM (SmolLM2-135M shape, batch 1, 128 tokens):
compile time (trace + cost annotation; the first compile in a process also pays torch's one-time
lazy imports, reported separately as "cold"), and the median forward time of the compiled model
and of the eager model measured interleaved, printed as a ratio (goal: <= 1.03).

    python benchmarks/compile_overhead.py [--repeats 7]
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
from examples.models import ZOO  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, batch: int, repeats: int, cold: bool) -> dict:
    """Compile times and the compiled/eager forward ratio for one zoo model."""
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    inputs = model.example_inputs(batch)
    first = _timed(lambda: tidal.compile(model, inputs))
    warm = [_timed(lambda: tidal.compile(model, inputs)) for _ in range(3)]
    compiled = tidal.compile(model, inputs)
    eager_t, compiled_t = [], []
    with torch.no_grad():
        model(*inputs), compiled(*inputs)  # warm-up
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            eager_t.append(_timed(lambda: model(*inputs)))
            compiled_t.append(_timed(lambda: compiled(*inputs)))
    return {"model": name, "batch": batch, "cold_s": first if cold else None,
            "compile_s": statistics.median(warm),
            "eager_ms": statistics.median(eager_t) * 1e3,
            "compiled_ms": statistics.median(compiled_t) * 1e3,
            "ratio": statistics.median(compiled_t) / statistics.median(eager_t)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = [measure("resnet50", 8, args.repeats, cold=True),
            measure("llama_decoder", 1, args.repeats, cold=False)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(f"{'model':15s} {'batch':>5s} {'cold compile s':>15s} {'compile s':>10s} "
          f"{'eager ms':>9s} {'compiled ms':>12s} {'ratio':>6s}")
    for r in rows:
        cold = f"{r['cold_s']:.2f}" if r["cold_s"] is not None else "-"
        print(f"{r['model']:15s} {r['batch']:5d} {cold:>15s} {r['compile_s']:10.2f} "
              f"{r['eager_ms']:9.1f} {r['compiled_ms']:12.1f} {r['ratio']:6.3f}")
    print("goals: compile (trace + cost annotation) < 2 s for ResNet-50; forward ratio <= 1.03")
    print("cold = first compile in the process, including torch's one-time lazy import of "
          "torch._dynamo by its meta kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
