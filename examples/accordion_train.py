"""Accordion on a small convergence run: data sent and final accuracy of PowerSGD with fixed low
compression (rank 4), fixed high compression (rank 1), and Accordion switching between them.

Synthetic 10-class data (a random two-layer ReLU teacher labels Gaussian inputs), an MLP student,
SGD with a 10x learning-rate decay two thirds of the way. Each run uses the ``compression``
pass (one process: the compressors still encode and decode, with error feedback); Accordion
decides once per epoch, per tensor (eta 0.5); it is given the learning-rate schedule, so the
epoch that starts at the decayed rate is critical (a decay ahead, not one window late).

    python examples/accordion_train.py [--epochs 12]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from tidal.passes.compression import CompressionPass  # noqa: E402

DIM, CLASSES, TRAIN, TEST, BATCH = 32, 10, 4000, 1000, 50


def make_data(seed: int = 0):
    """Gaussian inputs labelled by a random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(DIM, 16, generator=g), torch.randn(16, CLASSES, generator=g)
    x = torch.randn(TRAIN + TEST, DIM, generator=g)
    y = (torch.relu(x @ w1) @ w2).argmax(1)
    return (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


def student() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, CLASSES))


def lr_schedule(epochs: int):
    """The learning rate of each optimizer step: 0.1, then 0.01 for the last third."""
    steps = TRAIN // BATCH
    return lambda step: 0.1 if step // steps < 2 * epochs // 3 else 0.01


def train(label: str, epochs: int, **pass_options) -> tuple[str, float, float, list]:
    """Train one student; return (label, test accuracy, million floats sent, critical windows)."""
    (x, y), (xt, yt) = make_data()
    model = student()
    steps = TRAIN // BATCH
    compiled = tidal.compile(model, x[:BATCH], passes=[CompressionPass(**pass_options)],
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    opt = compiled.optimizer
    schedule = lr_schedule(epochs)
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = schedule(epoch * steps)
        perm = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(epoch))
        for i in range(steps):
            idx = perm[i * BATCH:(i + 1) * BATCH]
            compiled.step((x[idx],), y[idx])
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    ex = compiled.executor
    windows = [len(h) for h in ex.accordion.history] if ex.accordion else []
    return label, acc, ex.comm.bytes_sent / 4 / 1e6, windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps = TRAIN // BATCH
    runs = [train("rank 4 (low compression)", args.epochs, compressor="powersgd:4"),
            train("rank 1 (high compression)", args.epochs, compressor="powersgd:1"),
            train("Accordion 4/1", args.epochs, compressor="powersgd:4", accordion=(4, 1),
                  accordion_interval=steps, accordion_lr_schedule=lr_schedule(args.epochs)),
            train("no compression", args.epochs, compressor="powersgd:4", mode="off")]
    base = runs[0][2]
    print(f"{'run':<28}{'test acc':>9}{'M floats sent':>15}{'vs rank 4':>11}")
    for label, acc, sent, windows in runs:
        print(f"{label:<28}{acc:>9.3f}{sent:>15.2f}{base / sent:>10.2f}x")
    print("Accordion: critical tensors per epoch window:", runs[2][3])


if __name__ == "__main__":
    main()
