"""The training step of ``train_step`` (same weights, same batches, batch 1 and 32) with the
model through ``torch.compile(mode="reduce-overhead")`` (loss and optimizer eager), against
eager: the largest parameter difference after a few steps and ms/step. Skipped on the CPU
(its compile takes about 30 s even for a tiny model there)."""
from __future__ import annotations

import torch

from benchmarks.gpu_check.train_step import measure

SUMMARY = ("b1.eager.ms", "b1.torch_compile.ms", "b32.eager.ms", "b32.torch_compile.ms",
           "b1.torch_compile.max_dparam", "b32.torch_compile.max_dparam", "torch_compile")


def run(device: str, quick: bool) -> dict:
    if torch.device(device).type != "cuda":
        return {"torch_compile": "skipped on cpu"}
    return measure(device, quick, ("eager", "torch_compile"))
