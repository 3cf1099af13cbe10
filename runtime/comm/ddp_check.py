"""Does a tidal DDP comm hook train like DDP? The check a GPU harness runs on an NCCL group of one.

:func:`ddp_hook_check` trains a small MLP with ``torch.nn.parallel.DistributedDataParallel``
twice from the same weights and batches: once with DDP's own all-reduce, once with one of
:mod:`tidal.runtime.comm.ddp_hooks`' hooks registered, its compression effectively off (plain
averaging; Top-K and random-K keeping every coordinate; PowerSGD at full rank). It runs in this
process on a default group of one rank that it starts and ends itself
(:func:`~tidal.runtime.distributed.single_rank_group`: NCCL on CUDA, gloo on the CPU). The
hooks' :class:`~tidal.runtime.comm.compressors.Comm` issues its collectives even in a group of one
(``issue_alone``), so on a machine with one GPU the check runs the hooks' real path: buckets
on the GPU, NCCL all-reduces and all-gathers issued asynchronously, decoding in callbacks
chained on their CUDA futures. It also sends every compressor's messages (Top-K's all-gather of
values and int32 indices, QSGD's 16-bit levels, signSGD's packed bits, PowerSGD's two rounds)
through those collectives and compares the result with the same compressor run without
communication. Per hook it returns the largest difference of the losses and the parameters from
plain DDP and whether it is within the hook's tolerance (:data:`EXACT_TOL` for the exact ones);
per compressor whether the two runs are equal. The result is JSON-ready.

Example:
    >>> from tidal.runtime.comm.ddp_check import ddp_hook_check
    >>> result = ddp_hook_check("cpu", steps=2, hooks=("allreduce",), compressors=("qsgd:200",))
    >>> result["backend"], result["ok"], result["hooks"]["allreduce"]["max_param_diff"]
    ('gloo', True, 0.0)
    >>> result["compressors"]["qsgd:200"]
    {'max_diff': 0.0, 'ok': True}
"""
# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import copy
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tidal.runtime.comm import ddp_hooks
from tidal.runtime.comm.compressors import Comm, LocalComm, make_compressor, synchronize
from tidal.runtime.distributed import single_rank_group

WIDTH, CLASSES, BATCH = (16, 32), 4, 8
"""The MLP (input and hidden widths), its classes and the batch of :func:`ddp_hook_check`."""

EXACT_TOL = 1e-6
"""Tolerance of the hooks that compute what DDP computes (bit-equal expected; the margin keeps a
GPU's kernel choices from failing the check)."""

HOOKS = MappingProxyType({
    "allreduce": (ddp_hooks.allreduce, ddp_hooks.allreduce_state, EXACT_TOL),
    "topk": (ddp_hooks.topk, lambda m: ddp_hooks.topk_state(m, 1.0), EXACT_TOL),
    "randomk": (ddp_hooks.randomk, lambda m: ddp_hooks.randomk_state(m, 1.0), EXACT_TOL),
    "powersgd": (ddp_hooks.powersgd,
                 lambda m: ddp_hooks.powersgd_state(m, max(WIDTH), min_compression_rate=0),
                 1e-4),
})
"""The hooks checked, by name: (hook, state from the module, tolerance), each with its
compression off (Top-K/random-K keep every coordinate, PowerSGD at full rank), so that it must
give DDP's own result."""

COMPRESSORS = ("topk:0.25", "randomk:0.25", "signsgd", "qsgd:200",
               "powersgd:2,min_compression_rate=0")
"""The compressor specs whose messages :func:`ddp_hook_check` sends through the collectives
(QSGD with 200 levels puts int16 on the wire)."""


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH[0], WIDTH[1]), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH[1], CLASSES)).to(device)


def _train(device: torch.device, steps: int, hook: Optional[tuple[Callable, Callable]] = None
           ) -> tuple[list[float], list[torch.Tensor], int]:
    """Losses, final parameters and hook calls of ``steps`` SGD steps of DDP (with ``hook``:
    ``(hook, state from the module)``, its collectives issued in the group of one)."""
    model = _model(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                  else None)
    calls = [0]
    if hook is not None:
        fn, make_state = hook
        state = make_state(model)
        state.comm = Comm(state.comm.group, issue_alone=True)

        def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls[0] += 1
            return fn(state, bucket)
        ddp.register_comm_hook(state, counted)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH[0], generator=gen).to(device)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().cpu() for p in model.parameters()], calls[0]


def _through_collectives(spec: str, device: torch.device, steps: int) -> float:
    """The largest difference between ``spec`` synchronized through the group's collectives
    (issued by the one rank) and without communication, over ``steps`` steps."""
    sent, local = make_compressor(spec), make_compressor(spec)
    comm = Comm(issue_alone=True)
    gen = torch.Generator().manual_seed(2)
    diff = 0.0
    for _ in range(steps):
        grads = {"w": torch.randn(WIDTH[1], WIDTH[0], generator=gen).to(device),
                 "b": torch.randn(WIDTH[1], generator=gen).to(device)}
        out = synchronize(sent, grads, comm)
        ref = synchronize(local, copy.deepcopy(grads), LocalComm())
        diff = max([diff] + [float((out[k] - ref[k]).abs().max()) for k in grads])
    return diff


def ddp_hook_check(device: torch.device | str = "cuda", *, steps: int = 4,
                   hooks: Sequence[str] = tuple(HOOKS),
                   compressors: Sequence[str] = COMPRESSORS) -> dict[str, Any]:
    """On a process group of one rank on ``device`` (NCCL for CUDA, gloo for the CPU) that this
    call starts and ends: train DDP without a hook and with each of ``hooks`` (names of
    :data:`HOOKS`) for ``steps`` steps, and send each of ``compressors`` (specs) through the
    collectives for ``steps`` steps. Returns ``{"device", "backend", "steps", "hooks": {name:
    {"max_loss_diff", "max_param_diff", "tolerance", "hook_calls", "ok"}}, "compressors":
    {spec: {"max_diff", "ok"}}, "ok"}``. A hook is ok when it ran and every loss and
    parameter is within its tolerance of plain DDP's; a compressor when both runs are equal.
    Raises ``RuntimeError`` when a process group is already initialised in this process."""
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown:
        raise ValueError(f"ddp_hook_check: unknown hook(s) {unknown}; known: {sorted(HOOKS)}")
    with single_rank_group(device) as dev:
        backend = str(dist.get_backend())
        ref_losses, ref_params, _ = _train(dev, steps)
        results = {}
        for name in hooks:
            fn, make_state, tol = HOOKS[name]
            losses, params, calls = _train(dev, steps, (fn, make_state))
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            param_diff = max(float((a - b).abs().max()) for a, b in zip(params, ref_params))
            results[name] = {"max_loss_diff": loss_diff, "max_param_diff": param_diff,
                             "tolerance": tol, "hook_calls": calls,
                             "ok": calls > 0 and loss_diff <= tol and param_diff <= tol}
        sent = {}
        for spec in compressors:
            diff = _through_collectives(spec, dev, steps)
            sent[spec] = {"max_diff": diff, "ok": diff == 0.0}
    return {"device": str(dev), "backend": backend, "steps": steps, "hooks": results,
            "compressors": sent,
            "ok": all(r["ok"] for r in [*results.values(), *sent.values()])}
