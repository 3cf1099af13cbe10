"""DDP communication hooks that compress gradients, as ``torch.distributed.algorithms.
ddp_comm_hooks`` users expect them: ``from tidal.hooks import powersgd, powersgd_state``.

    state = powersgd_state(model, rank=4)            # or topk_state(model, 0.01), ...
    ddp_model.register_comm_hook(state, powersgd)     # asynchronous: DDP overlaps the sync
    ddp_model.register_comm_hook(state, bf16_wrapper(powersgd))   # P and Q sent as bfloat16
    ddp_model.register_comm_hook(None, bf16)          # plain averaging, bfloat16 payload

The hooks live in :mod:`tidal.runtime.comm.ddp_hooks`; this module re-exports their public names.

Example:
    >>> import torch
    >>> from tidal.hooks import topk_state
    >>> topk_state(torch.nn.Linear(4, 2), 0.5).compressor.spec()
    'topk:0.5'
"""
from tidal.runtime.comm.ddp_hooks import (HOOKS, Hook, HookState, allreduce, allreduce_state, bf16,
                                     bf16_wrapper, fp16, fp16_wrapper, hook_for, powersgd,
                                     powersgd_state, qsgd, qsgd_state, randomk, randomk_state,
                                     signsgd, signsgd_state, topk, topk_state)

__all__ = ["HOOKS", "Hook", "HookState", "allreduce", "allreduce_state", "bf16", "bf16_wrapper",
           "fp16", "fp16_wrapper", "hook_for", "powersgd", "powersgd_state", "topk", "topk_state",
           "randomk", "randomk_state", "signsgd", "signsgd_state", "qsgd", "qsgd_state"]
