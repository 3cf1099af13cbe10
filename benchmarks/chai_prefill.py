"""CHAI in the compiled graph: prefill time with ``tidal::clustered_attention`` at fixed k.

A Hugging Face Llama with SmolLM2-135M's attention shape (9 heads, 3 KV heads, head dim 64;
randomly initialised, ``--layers`` layers) runs one forward over ``--tokens`` tokens: HF's own
model (sdpa), the compiled graph without passes, and the compiled graph with
``clustered_attention`` at k = 9 (every head its own cluster), 3 and 1. Printed: median ms over
``--repeats`` runs and the ratio to the compiled graph without passes (same process, one
thread). CPU figures, not GPU ones. The decode path with the model's own pruned K cache is not
in ``compile()`` yet (issue 20); ``make bench-chai`` measures tidal's side decoder.

    python benchmarks/chai_prefill.py [--tokens 1024] [--layers 4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first run warms up
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    import tidal
    from tidal.passes.clustered_attention import ClusteredAttention

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=args.layers, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=max(2048, args.tokens),
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, args.tokens))
    runs = {"HF model (sdpa)": lambda: model(ids, use_cache=False)}
    plain = tidal.compile(model, (ids,))
    runs["compiled, no passes"] = lambda: plain(ids)
    for k in (9, 3, 1):
        c = tidal.compile(model, (ids,), passes=[ClusteredAttention(clusters=k)])
        runs[f"compiled, clustered_attention k={k}"] = (lambda c=c: c(ids))
    times = {name: _median_ms(fn, args.repeats) for name, fn in runs.items()}
    base = times["compiled, no passes"]
    print(f"prefill of {args.tokens} tokens, {args.layers} layers, 9 heads / 3 KV heads, one "
          f"thread (CPU, not a GPU figure)")
    for name, ms in times.items():
        print(f"  {name:38s} {ms:9.1f} ms  x{ms / base:.3f} of the compiled graph")
    return 0


if __name__ == "__main__":
    sys.exit(main())
