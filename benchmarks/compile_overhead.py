"""Compile overhead and forward overhead of ``Compiled`` vs eager, in one process.

For ResNet-50 (batch 8, 224x224) and the decoder LM (SmolLM2-135M shape, batch 1, 128 tokens):
compile time (trace + cost annotation; the first compile in a process also pays torch's one-time
lazy imports, reported separately as "cold"), and the median forward time of the compiled model
and of the eager model measured interleaved, printed as a ratio (goal: <= 1.03).

    python benchmarks/compile_overhead.py [--repeats 7] [--hf]

``--hf``: the capture of Hugging Face decoders, GPT-2 small and a 12-layer Llama-shaped model
(random weights, batch 1, 128 tokens): ``tidal.trace`` (the path tidal takes for them,
``torch.export`` non-strict, then the graph rebuilt) beside a bare
``torch.export.export(model, (), inputs, strict=False)`` (what a user would run; the ratio
tidal / export is printed) and ``transformers.utils.fx.symbolic_trace`` (the path tidal took
before, present only in transformers 4.x), and whole ``tidal.compile`` times, medians of 3.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

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


def hf_decoders() -> dict:
    """GPT-2 small and a 12-layer Llama-shaped model (SmolLM2's width), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=32000, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=12, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=512)
    return {"gpt2-small": GPT2LMHeadModel(GPT2Config()).eval(),
            "llama-12L": LlamaForCausalLM(llama).eval()}


def _hf_fx_trace(model, names) -> Optional[float]:
    """Seconds of ``transformers.utils.fx.symbolic_trace`` (None where transformers has none)."""
    try:
        from transformers.utils.fx import symbolic_trace
    except ImportError:
        return None
    return _timed(lambda: symbolic_trace(model, input_names=names))


def measure_hf(name: str, model: torch.nn.Module, tokens: int = 128, repeats: int = 3) -> dict:
    """Capture and compile times of one HF decoder (see the module docstring)."""
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (1, tokens))}
    trace_s = statistics.median(_timed(lambda: tidal.trace(model, inputs))
                                for _ in range(repeats))
    export_s = statistics.median(_timed(lambda: torch.export.export(
        model, (), dict(inputs, use_cache=False), strict=False)) for _ in range(repeats))
    fx = [_hf_fx_trace(model, list(inputs)) for _ in range(repeats)]
    fx_s = statistics.median(fx) if None not in fx else None
    compile_s = statistics.median(_timed(lambda: tidal.compile(model, inputs))
                                  for _ in range(repeats))
    return {"model": name, "trace_s": trace_s, "export_s": export_s, "fx_s": fx_s,
            "compile_s": compile_s, "ratio": trace_s / export_s,
            "fx_ratio": trace_s / fx_s if fx_s else None}


def main_hf() -> int:
    """The ``--hf`` table."""
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, CPU")
    print(f"{'model':11s} {'tidal.trace s':>13s} {'torch.export s':>14s} {'tidal/export':>12s} "
          f"{'HF utils.fx s':>13s} {'tidal/fx':>8s} {'tidal.compile s':>15s}")
    for name, model in hf_decoders().items():
        r = measure_hf(name, model)
        fx = f"{r['fx_s']:.2f}" if r["fx_s"] is not None else "absent"
        fx_ratio = f"{r['fx_ratio']:.2f}" if r["fx_ratio"] is not None else "-"
        print(f"{name:11s} {r['trace_s']:13.2f} {r['export_s']:14.2f} {r['ratio']:12.2f} "
              f"{fx:>13s} {fx_ratio:>8s} {r['compile_s']:15.2f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hf", action="store_true",
                        help="capture times of HF decoders: torch.export against HF's fx tracer")
    args = parser.parse_args(argv)
    if args.hf:
        return main_hf()
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
