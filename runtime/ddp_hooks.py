"""The compressors as standard DDP communication hooks, for users who never call ``compile()``.

    state = powersgd_state(model, rank=4)            # or topk_state(model, 0.01), ...
    ddp_model.register_comm_hook(state, powersgd)     # exposed as tidal.hooks.powersgd

A hook receives one DDP bucket, compresses each of its gradients with the state's compressor,
runs the collectives on the state's process group, and returns a completed future holding the
bucket's flat buffer filled with the synchronized (averaged, or majority-voted) gradients. Keys
are parameter names when the state was given the module (so they survive DDP's bucket rebuild
after the first iteration, and match the ``compression`` pass), else ``bucket<i>.<j>``.

Example:
    >>> import torch
    >>> from tidal.runtime.ddp_hooks import topk_state
    >>> state = topk_state(torch.nn.Linear(4, 2), 0.5)
    >>> state.compressor.spec(), sorted(state.names.values())
    ('topk:0.5', ['bias', 'weight'])
"""
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from tidal.runtime.compressors import (Comm, Compressor, PowerSGD, QSGD, RandomK, SignSGD, TopK,
                                       synchronize)

# No ``from __future__ import annotations`` in this module: DDP checks the hooks' annotations
# as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
HookFuture = torch.futures.Future[torch.Tensor]


class HookState:
    """What a compression hook needs: the compressor (with its residuals and warm-start state),
    the process group, and parameter names by identity."""

    def __init__(self, compressor: Compressor, module: Optional[torch.nn.Module] = None, *,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.compressor = compressor
        self.comm = Comm(process_group)
        self.names = {id(p): n for n, p in module.named_parameters()} if module is not None \
            else {}

    def keys(self, bucket: dist.GradBucket) -> list[str]:
        """The compressor keys of the bucket's gradients."""
        params = bucket.parameters()
        return [self.names.get(id(p), f"bucket{bucket.index()}.{j}")
                for j, p in enumerate(params)]

    def state_dict(self) -> dict[str, Any]:
        """The compressor's checkpoint state."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the compressor's state."""
        self.compressor.load_state_dict(state)


def _run(state: HookState, bucket: dist.GradBucket, kind: type) -> HookFuture:
    if not isinstance(state, HookState) or not isinstance(state.compressor, kind):
        got = type(getattr(state, "compressor", state)).__name__
        raise TypeError(f"the {kind.name} hook needs a HookState with a {kind.__name__} "
                        f"compressor (from {kind.name}_state(...)), got {got}")
    grads = bucket.gradients()
    out = synchronize(state.compressor, dict(zip(state.keys(bucket), grads)), state.comm)
    buffer = bucket.buffer()
    offset = 0
    for g, synced in zip(grads, out.values()):
        n = g.numel()
        buffer[offset:offset + n].copy_(synced.reshape(-1))
        offset += n
    fut: HookFuture = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def powersgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: PowerSGD (state from :func:`powersgd_state`)."""
    return _run(state, bucket, PowerSGD)


def topk(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: Top-K with error feedback (state from :func:`topk_state`)."""
    return _run(state, bucket, TopK)


def randomk(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: random-K with error feedback (state from :func:`randomk_state`)."""
    return _run(state, bucket, RandomK)


def signsgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: signSGD with majority vote (state from :func:`signsgd_state`)."""
    return _run(state, bucket, SignSGD)


def qsgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: QSGD (state from :func:`qsgd_state`)."""
    return _run(state, bucket, QSGD)


def powersgd_state(module: Optional[torch.nn.Module] = None, rank: int = 4, *,
                   process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> HookState:
    """State for :func:`powersgd`; ``options`` go to :class:`PowerSGD`."""
    return HookState(PowerSGD(rank, **options), module, process_group=process_group)


def topk_state(module: Optional[torch.nn.Module] = None, fraction: float = 0.01, *,
               process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> HookState:
    """State for :func:`topk`; ``options`` go to :class:`TopK`."""
    return HookState(TopK(fraction, **options), module, process_group=process_group)


def randomk_state(module: Optional[torch.nn.Module] = None, fraction: float = 0.01, *,
                  process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> HookState:
    """State for :func:`randomk`; ``options`` go to :class:`RandomK`."""
    return HookState(RandomK(fraction, **options), module, process_group=process_group)


def signsgd_state(module: Optional[torch.nn.Module] = None, *,
                  process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> HookState:
    """State for :func:`signsgd`; ``options`` go to :class:`SignSGD`."""
    return HookState(SignSGD(**options), module, process_group=process_group)


def qsgd_state(module: Optional[torch.nn.Module] = None, levels: int = 4, *,
               process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> HookState:
    """State for :func:`qsgd`; ``options`` go to :class:`QSGD`."""
    return HookState(QSGD(levels, **options), module, process_group=process_group)


HOOKS = MappingProxyType({"powersgd": powersgd, "topk": topk, "randomk": randomk,
                          "signsgd": signsgd, "qsgd": qsgd})
"""Hook functions by compressor name."""


def hook_for(compressor: Compressor) -> Callable[..., HookFuture]:
    """The hook function that runs ``compressor``."""
    return HOOKS[compressor.name]
