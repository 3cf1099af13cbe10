"""A captured training step (forward + backward + optimizer) against eager PyTorch at batch 1
and 32: the largest parameter difference after a few steps from the same weights, and ms/step
(``torch.compile(mode="reduce-overhead")`` of the model is the check ``torch_compile``,
the same figures on the same weights: its first compile may take most of a minute).

tidal runs the step two ways: ``tidal.compile(model, x, loss_fn=..., optimizer=...)`` and
``compiled.step`` with no passes (``tidal``: the traced graph, lowered on a GPU, whose
segments run uncaptured under autograd, then the eager backward) and with
``passes=[CompressionPass(mode="off")]`` (``tidal_captured``: one process's data-parallel
program, the joint forward+backward graph captured, CUDA graphs on a GPU)."""
from __future__ import annotations

import copy
from types import MappingProxyType

import torch

import tidal
from benchmarks.gpu_check.common import fail, max_param_diff, mlp, ms_per_call, sync
from tidal.passes.compression import CompressionPass

SUMMARY = ("b1.eager.ms", "b1.tidal.ms", "b1.tidal_captured.ms", "b32.eager.ms",
           "b32.tidal.ms", "b32.tidal_captured.ms", "b1.tidal_captured.max_dparam",
           "b32.tidal_captured.max_dparam")
TOL = 1e-4
"""Largest parameter difference accepted after the equality steps (float32)."""


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _eager(model: torch.nn.Module, x, y):
    """The eager step on ``model`` (its own optimizer), and the model."""
    opt = _sgd(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step, model


def _tidal(model: torch.nn.Module, x, y, passes=()):
    compiled = tidal.compile(model, (x,), loss_fn=_loss, optimizer=_sgd, passes=list(passes))
    return (lambda: compiled.step((x,), y)), compiled.model


def _torch_compile(model: torch.nn.Module, x, y):
    """The model through ``torch.compile(mode="reduce-overhead")`` (its forward and backward
    in CUDA graphs), the loss and optimizer eager: what a user writes. (The whole step
    compiled fails on torch 2.11: SGD's momentum clones a gradient that the next replay
    overwrites.)"""
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    opt = _sgd(model.parameters())

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = _loss(compiled(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step, model


VARIANTS = MappingProxyType({
    "eager": _eager,
    "tidal": _tidal,
    "tidal_captured": lambda m, x, y: _tidal(m, x, y, [CompressionPass(mode="off")]),
    "torch_compile": _torch_compile,
})
"""Each way of running the step: ``make(model, x, y) -> (step, model it trains)``."""


def at_batch(batch: int, widths: list[int], device: torch.device, variants: tuple[str, ...],
             equal_steps: int, timed_steps: int) -> dict:
    """Figures ``b<batch>.<variant>.ms`` and ``.max_dparam`` (against eager after
    ``equal_steps`` steps from the same weights) of each of ``variants``; a variant that
    raises is recorded (``.error``) and the others go on."""
    base = mlp(widths, seed=batch, norm=True).to(device)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, widths[0], generator=g).to(device)
    y = torch.randint(0, widths[-1], (batch,), generator=g).to(device)
    figures: dict = {}
    ran: dict = {}
    for name in variants:
        make = VARIANTS[name]
        try:
            step, model = make(copy.deepcopy(base), x, y)
            for _ in range(equal_steps):
                step()
            sync(device)
            ran[name] = (step, model)
        except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
            figures[f"b{batch}.{name}.error"] = f"{type(e).__name__}: {e}"
            fail(figures, f"batch {batch}: {name}: {type(e).__name__}: {e}")
    reference = ran.get("eager", (None, None))[1]
    for name, (step, model) in ran.items():
        if name != "eager" and reference is not None:
            diff = max_param_diff(reference, model)
            figures[f"b{batch}.{name}.max_dparam"] = diff
            if not diff <= TOL:
                fail(figures, f"batch {batch}: {name} differs from eager by {diff:.3g} after "
                              f"{equal_steps} steps (tolerance {TOL})")
    for name, (step, _) in ran.items():
        figures[f"b{batch}.{name}.ms"] = ms_per_call(step, device, timed_steps, warmup=0)
    return figures


def measure(device: str, quick: bool, variants: tuple[str, ...]) -> dict:
    """``at_batch`` figures of ``variants`` (``VARIANTS`` names, eager first) at batch 1 and
    32; the same weights and batches whichever variants run."""
    dev = torch.device(device)
    widths = [32, 64, 64, 10] if quick else [1024, 4096, 4096, 1000]
    figures: dict = {"widths": "x".join(map(str, widths))}
    for batch in (1, 32):
        part = at_batch(batch, widths, dev, variants, equal_steps=3,
                        timed_steps=3 if quick else 30)
        for message in part.pop("failures", []):
            fail(figures, message)
        figures.update(part)
    return figures


def run(device: str, quick: bool) -> dict:
    return measure(device, quick, ("eager", "tidal", "tidal_captured"))
