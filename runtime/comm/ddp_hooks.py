"""The compressors as standard DDP communication hooks, for users who never call ``compile()``.

    state = powersgd_state(model, rank=4)            # or topk_state(model, 0.01), ...
    ddp_model.register_comm_hook(state, powersgd)     # exposed as tidal.hooks.powersgd

A hook receives one DDP bucket, encodes each of its gradients with the state's compressor (in
the hook, on the gradients' device), issues the collectives with ``async_op=True`` on the
state's process group and returns at once: a future chained on them (``.then``, as PyTorch's
``powerSGD_hook``), which decodes each round in a callback, issues the next, and completes with
the bucket's flat buffer holding the synchronized (averaged, or majority-voted) gradients. So
DDP overlaps the sync with the rest of the backward. Gradients may be float32, bfloat16 or
float16: the compressors compute in float32 (PowerSGD orthogonalises in float32) and write the
result back in the bucket's dtype. A state's calls are issued in bucket order, the same on
every rank (:class:`tidal.runtime.comm.compressors.Lane`), which PyTorch's ``powerSGD_hook`` does not
do on gloo.

``fp16``/``bf16`` average the bucket with its payload in half precision (PyTorch's
``fp16_compress_hook``/``bf16_compress_hook``); ``fp16_wrapper(hook)``/``bf16_wrapper(hook)``
do the same around any hook here: ``bf16_wrapper(powersgd)`` sends PowerSGD's P and Q as
bfloat16 (decoded, orthogonalised, in float32).

Keys are parameter names when the state was given the module (so they survive DDP's bucket
rebuild after the first iteration, match the ``compression`` pass, and carry over to a fresh
model), else ``bucket<i>.<j>``. Checkpoint a state with ``state_dict()`` (tensors, numbers and
strings only, so ``torch.load(..., weights_only=True)`` reads it back) and restore it into a
fresh DDP model with :meth:`HookState.from_state_dict` or ``load_state_dict``.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.ddp_hooks import HookState, bf16_wrapper, powersgd, topk_state
    >>> state = topk_state(torch.nn.Linear(4, 2), 0.5)
    >>> state.compressor.spec(), sorted(state.names.values())
    ('topk:0.5', ['bias', 'weight'])
    >>> HookState.from_state_dict(state.state_dict(), torch.nn.Linear(4, 2)).compressor.spec()
    'topk:0.5'
    >>> bf16_wrapper(powersgd).__name__
    'bf16_powersgd'
"""
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from tidal.runtime.comm.compressors import (Comm, Compressor, NoCompression, PowerSGD, QSGD, RandomK,
                                       SignSGD, TopK, check_wire_dtype, make_compressor,
                                       synchronize_async)

# No ``from __future__ import annotations`` in this module: DDP checks the hooks' annotations
# as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
HookFuture = torch.futures.Future[torch.Tensor]
Hook = Callable[[Any, dist.GradBucket], HookFuture]


class HookState:
    """What a compression hook needs: the compressor (with its residuals and warm-start state),
    the process group (through a :class:`~tidal.runtime.comm.compressors.Comm`, which orders the
    state's collectives), and parameter names by identity."""

    def __init__(self, compressor: Compressor, module: Optional[torch.nn.Module] = None, *,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.compressor = compressor
        self.comm = Comm(process_group)
        self.comm.check(compressor)
        self.named = module is not None
        self.names = {id(p): n for n, p in module.named_parameters()} if module is not None \
            else {}

    def keys(self, bucket: dist.GradBucket) -> list[str]:
        """The compressor keys of the bucket's gradients. A state built for a module refuses
        a parameter that is not the module's (a state registered on another model)."""
        keys = []
        for j, p in enumerate(bucket.parameters()):
            name = self.names.get(id(p))
            if name is None:
                if self.named:
                    raise ValueError(f"HookState: a parameter of shape {tuple(p.shape)} in DDP "
                                     f"bucket {bucket.index()} is not a parameter of the module "
                                     "this state was built for; build the state for the model "
                                     "DDP wraps (HookState.from_state_dict(saved, model))")
                name = f"bucket{bucket.index()}.{j}"
            keys.append(name)
        return keys

    def state_dict(self) -> dict[str, Any]:
        """The compressor's checkpoint state and its spec (tensors, numbers and strings: it
        loads with ``torch.load(..., weights_only=True)``). Take it between steps."""
        return {"spec": self.compressor.spec(), **self.compressor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the compressor's state (residuals and warm-start ``Q`` move to the
        gradients' device on first use)."""
        self.compressor.load_state_dict(state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], module: Optional[torch.nn.Module] = None,
                        *, process_group: Optional[dist.ProcessGroup] = None) -> "HookState":
        """A state rebuilt from :meth:`state_dict` (its spec, then its contents) for
        ``module``: register it on a fresh DDP model to continue where the saved one stopped."""
        if "spec" not in state:
            raise ValueError("HookState.from_state_dict: the state has no 'spec' (not from "
                             "HookState.state_dict()); build the state with <name>_state(...) "
                             "and call load_state_dict")
        out = cls(make_compressor(state["spec"]), module, process_group=process_group)
        out.load_state_dict(state)
        return out


def _state_for(hook: str, state: Any, kind: type) -> HookState:
    """``state`` checked against the hook's compressor class; the plain averaging hooks also
    take None or a process group, as PyTorch's do."""
    if kind is NoCompression and (state is None or isinstance(state, dist.ProcessGroup)):
        return HookState(NoCompression(), process_group=state)
    if not isinstance(state, HookState) or not isinstance(state.compressor, kind):
        got = type(getattr(state, "compressor", state)).__name__
        maker = "allreduce" if kind is NoCompression else kind.name
        raise TypeError(f"the {hook} hook needs a HookState with a {kind.__name__} "
                        f"compressor (from {maker}_state(...)), got {got}")
    return state


def _run(hook: str, state: Any, bucket: dist.GradBucket, kind: type,
         wire_dtype: Optional[torch.dtype] = None) -> HookFuture:
    """Encode the bucket now, issue its collectives asynchronously, and return a future of the
    bucket's buffer, the synchronized gradients written into it."""
    state = _state_for(hook, state, kind)
    buffer = bucket.buffer()
    grads = bucket.gradients()
    keys = state.keys(bucket)
    views, offset = {}, 0
    for k, g in zip(keys, grads):         # the results go straight into the buffer
        views[k] = buffer[offset:offset + g.numel()].view(g.shape)
        offset += g.numel()
    fut = synchronize_async(state.compressor, dict(zip(keys, grads)), state.comm,
                            wire_dtype=wire_dtype, out=views)

    def the_buffer(done: torch.futures.Future) -> torch.Tensor:
        done.value()                      # raises what the sync raised
        return buffer
    return fut.then(the_buffer)


def powersgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: PowerSGD (state from :func:`powersgd_state`)."""
    return _run("powersgd", state, bucket, PowerSGD)


def topk(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: Top-K with error feedback (state from :func:`topk_state`)."""
    return _run("topk", state, bucket, TopK)


def randomk(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: random-K with error feedback (state from :func:`randomk_state`)."""
    return _run("randomk", state, bucket, RandomK)


def signsgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: signSGD with majority vote (state from :func:`signsgd_state`)."""
    return _run("signsgd", state, bucket, SignSGD)


def qsgd(state: HookState, bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: QSGD (state from :func:`qsgd_state`)."""
    return _run("qsgd", state, bucket, QSGD)


def allreduce(state: Optional[HookState], bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: plain averaging all-reduce (state from :func:`allreduce_state`, or None or a
    process group as for PyTorch's ``allreduce_hook``)."""
    return _run("allreduce", state, bucket, NoCompression)


def fp16(state: Optional[HookState], bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: averaging all-reduce with the payload in float16 (each rank's share divided
    by the world size before the cast, as PyTorch's ``fp16_compress_hook``, so the sum does not
    overflow float16's 65504). State as for :func:`allreduce`."""
    return _run("fp16", state, bucket, NoCompression, torch.float16)


def bf16(state: Optional[HookState], bucket: dist.GradBucket) -> HookFuture:
    """DDP hook: averaging all-reduce with the payload in bfloat16. State as for
    :func:`allreduce`."""
    return _run("bf16", state, bucket, NoCompression, torch.bfloat16)


HOOKS = MappingProxyType({"powersgd": powersgd, "topk": topk, "randomk": randomk,
                          "signsgd": signsgd, "qsgd": qsgd, "none": allreduce})
"""Hook functions by compressor name (``none``: :func:`allreduce`)."""

_KINDS = MappingProxyType({powersgd: PowerSGD, topk: TopK, randomk: RandomK, signsgd: SignSGD,
                           qsgd: QSGD, allreduce: NoCompression})


def _wire_wrapper(hook: Hook, wire_dtype: torch.dtype, tag: str) -> Hook:
    kind = _KINDS.get(hook)
    if kind is None:
        raise ValueError(f"{tag}_wrapper: {getattr(hook, '__name__', hook)!r} is not one of "
                         f"tidal.hooks' compressor hooks ({', '.join(h.__name__ for h in _KINDS)})"
                         "; wrap the plain hook, once")
    name = f"{tag}_{hook.__name__}"

    def wrapped(state: Any, bucket: dist.GradBucket) -> HookFuture:
        return _run(name, state, bucket, kind, wire_dtype)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__doc__ = f"DDP hook: {hook.__name__} with its payload sent as {wire_dtype}."
    return wrapped


def fp16_wrapper(hook: Hook) -> Hook:
    """``hook`` (one of this module's compressor hooks) with every floating-point payload sent
    as float16 and cast back to float32 before decoding; takes the same state. As PyTorch's
    ``fp16_compress_wrapper``, e.g. ``fp16_wrapper(powersgd)``."""
    return _wire_wrapper(hook, torch.float16, "fp16")


def bf16_wrapper(hook: Hook) -> Hook:
    """As :func:`fp16_wrapper`, in bfloat16."""
    return _wire_wrapper(hook, torch.bfloat16, "bf16")


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


def allreduce_state(module: Optional[torch.nn.Module] = None, *,
                    process_group: Optional[dist.ProcessGroup] = None) -> HookState:
    """State for :func:`allreduce`, :func:`fp16` and :func:`bf16` (no compressor state)."""
    return HookState(NoCompression(), module, process_group=process_group)


def hook_for(compressor: Compressor, wire_dtype: Optional[torch.dtype] = None) -> Hook:
    """The hook function that runs ``compressor`` (its payload as ``wire_dtype`` when given:
    ``torch.float16`` or ``torch.bfloat16``)."""
    hook = HOOKS[compressor.name]
    if check_wire_dtype(wire_dtype, "hook_for") is None:
        return hook
    return (fp16_wrapper if wire_dtype == torch.float16 else bf16_wrapper)(hook)
