"""Checkpoints of a compiled model through ``torch.distributed.checkpoint`` (DCP).

:func:`get_state_dict` and :func:`set_state_dict` have the semantics of DCP's own
(``torch.distributed.checkpoint.state_dict``), on the compiled model: the model's state is
brought up to date on every rank first (under ``burst_parallel`` a rank's copies of layers it
does not run are stale: ``Compiled.state_dict()`` refreshes them, a collective), and each
optimizer's state is keyed by parameter name. Save the result with ``dcp.save``: a state a
rank holds alone (burst's owner-only optimizer state) is saved from that rank, a replicated one
once, so the checkpoint is sharded by ownership and loads on any world size, one process
included (``dcp.load`` into a template from :func:`get_state_dict` or DCP's own, then
:func:`set_state_dict`). What a plan's program holds per rank beside the model and the
optimizer (``Compiled.runtime_state_dict()``: tick_tock's second wave, compressor residuals)
is not in it: save it per rank (``torch.save``) when resuming on the same ranks.

Example:
    >>> import torch, tidal
    >>> from tidal.compiler.checkpoint import get_state_dict
    >>> c = tidal.compile(torch.nn.Linear(2, 2), (torch.randn(4, 2),))
    >>> opt = torch.optim.SGD(c.parameters(), lr=0.1)
    >>> model_state, optim_state = get_state_dict(c, opt)
    >>> sorted(model_state)
    ['bias', 'weight']
"""
from __future__ import annotations

from typing import Any, Iterable, Union

import torch
from torch.distributed.checkpoint import state_dict as dcp_state

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


def get_state_dict(compiled: Any, optimizers: Optimizers = (), **options: Any
                   ) -> tuple[dict[str, Any], Any]:
    """``(model state, optimizer state)`` of ``compiled`` (a ``Compiled``) and
    ``optimizers``, current on every rank (a collective under a plan that keeps stale copies:
    every rank calls it); ``options`` are DCP's ``StateDictOptions`` fields."""
    compiled.state_dict()   # brings stale copies up to date (burst_parallel)
    return dcp_state.get_state_dict(compiled.model, optimizers,
                                    options=dcp_state.StateDictOptions(**options))


def set_state_dict(compiled: Any, optimizers: Optimizers = (), *, model_state_dict: Any,
                   optim_state_dict: Any, **options: Any) -> Any:
    """Load ``model_state_dict`` and ``optim_state_dict`` (from :func:`get_state_dict`, as
    ``dcp.load`` filled them) into ``compiled``'s model, in place, and ``optimizers``."""
    return dcp_state.set_state_dict(compiled.model, optimizers,
                                    model_state_dict=model_state_dict,
                                    optim_state_dict=optim_state_dict,
                                    options=dcp_state.StateDictOptions(**options))
