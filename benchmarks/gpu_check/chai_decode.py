"""CHAI decode against Hugging Face ``generate`` on a tiny random Llama (``LlamaConfig``; no
weights downloaded): time to next token of HF ``generate``, ``compiled.generate`` at k clusters
and at one head per cluster, and the side decoder ``ChaiDecoder``; at k = H
``compiled.generate`` must give HF's greedy tokens (``benchmarks/chai_generate.py``'s
``tiny_ttnt``)."""
from __future__ import annotations

from benchmarks.chai_generate import tiny_ttnt
from benchmarks.gpu_check.common import fail

SUMMARY = ("equal", "context", "hf.ttnt_ms", "compiled_k.ttnt_ms", "compiled_k.x_vs_hf",
           "compiled_kH.x_vs_hf", "decoder_k.ttnt_ms", "decoder_k.x_vs_hf")


def run(device: str, quick: bool) -> dict:
    figures = dict(tiny_ttnt(device, context=32 if quick else 1024,
                             new_tokens=3 if quick else 32, repeats=1 if quick else 3))
    if not figures.get("equal"):
        fail(figures, "compiled.generate at one head per cluster differs from HF generate")
    return figures
