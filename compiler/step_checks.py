"""What ``Compiled.step`` / ``Compiled.backward`` check about a step's data and loss: an empty
global batch is an error (a step of 0 rows would return a NaN loss and change nothing), and
with ``tidal.compile(..., check_finite=True)`` a non-finite loss stops training with a
:class:`NonFiniteLossError` naming the step, the parameters and optimizer state left as they
were before it.

The loss a step returns is the global batch's (the programs reduce it over the ranks), so every
rank sees the same value and raises together, with no collective of its own.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> kept = StateSnapshot(model, opt)
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> kept.restore()                   # '': everything was put back
    ''
    >>> torch.equal(model.weight, kept.tensors["weight"])
    True
    >>> check_loss(torch.tensor(float("nan")), 3, "Compiled.step", "the parameters are as before")
    Traceback (most recent call last):
    ...
    tidal.compiler.step_checks.NonFiniteLossError: Compiled.step: the loss of step 3 is nan ...
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves

from tidal.ir.errors import TidalError
from tidal.runtime.batch_data import BatchError


class NonFiniteLossError(TidalError, FloatingPointError):
    """A step's loss was NaN or infinite under ``compile(check_finite=True)``; ``step`` is the
    1-based number of the call that raised."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


def check_rows(inputs: Any, targets: Any, where: str) -> None:
    """Raise ``BatchError`` when the global batch has 0 rows (dim 0 of its first tensor input),
    naming ``where``.

    >>> check_rows((torch.zeros(0, 3),), torch.zeros(0), "Compiled.step")
    Traceback (most recent call last):
    ...
    tidal.runtime.batch_data.BatchError: Compiled.step: the global batch is empty ...
    """
    first = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim()),
                 None)
    if first is not None and first.shape[0] == 0:
        raise BatchError(f"{where}: the global batch is empty (input of shape "
                         f"{tuple(first.shape)}: 0 rows, with every rank's rows joined): its "
                         f"loss would be NaN and the step would change nothing; skip empty "
                         f"batches (a rank's own batch may be empty under batch='local' when "
                         f"another rank's is not)")


class StateSnapshot:
    """A copy of a model's parameters and buffers (``tensors``, by state-dict name), of an
    optimizer's state and of what ``runtime`` (a ``Compiled``) holds beside them (its
    ``runtime_state_dict()``: tick_tock's second wave, compressor residuals), to put back
    with :meth:`restore` when a step must not have happened."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 runtime: Any = None):
        self._runtime = runtime
        self._runtime_state = None if runtime is None else \
            copy.deepcopy(runtime.runtime_state_dict())
        # the live tensors themselves (not state_dict(): burst_parallel refuses a state dict
        # holding a rank's stale copies, which it is harmless to save and put back here)
        self._live = dict([*model.named_parameters(), *model.named_buffers()])
        self.tensors = {k: v.detach().clone() for k, v in self._live.items()}
        self._optimizer = optimizer
        self._optimizer_state = None if optimizer is None else \
            copy.deepcopy(optimizer.state_dict())

    def restore(self) -> str:
        """Copy the saved values back into the live tensors (in place), the optimizer and the
        runtime state; return what could not be put back ("" when all was)."""
        with torch.no_grad():
            for name, live in self._live.items():
                live.copy_(self.tensors[name])
        if self._optimizer is not None:
            self._optimizer.load_state_dict(self._optimizer_state)
        if self._runtime_state:
            self._runtime.load_runtime_state_dict(self._runtime_state)
        elif self._runtime is not None and self._runtime.runtime_state_dict():
            return ("but the program's own state (e.g. tick_tock's second wave) was first made "
                    "in this step and is not finite: compile the model again")
        return ""


def check_loss(loss: torch.Tensor, step: int, where: str, state: str) -> None:
    """Raise :class:`NonFiniteLossError` when ``loss`` is not finite, naming ``where``, the
    ``step`` number and what became of the model (``state``)."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteLossError(
            f"{where}: the loss of step {step} is {loss.item() if loss.numel() == 1 else loss} "
            f"(compile(check_finite=True)); {state}. Look for the cause in this step's batch "
            f"or learning rate (every rank raises alike)", step=step)
