"""What a user expects of a module, on a compiled model (``Compiled`` inherits it).

``parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()``, ``state_dict()``
(current on every rank), ``load_state_dict()`` (in place), ``train(mode)``/``eval()``/
``training``, ``zero_grad()`` — the model's — and the program's own checkpoint state
(``runtime_state_dict``/``load_runtime_state_dict``). The class using it holds ``model``,
``graph_module``, ``executor``, ``context`` and ``optimizer``.

Example:
    >>> import torch, tidal
    >>> c = tidal.compile(torch.nn.Linear(2, 2), (torch.randn(4, 2),))
    >>> c.eval() is c, c.training, sorted(c.state_dict())
    (True, False, ['bias', 'weight'])
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch


class ModuleFace:
    """The module-like methods of ``Compiled`` (see the module docstring)."""

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The model's parameters (give them to your optimizer)."""
        return self.model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """The model's named parameters (``nn.Module.named_parameters``)."""
        return self.model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The model's buffers."""
        return self.model.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """The model's named buffers (``nn.Module.named_buffers``)."""
        return self.model.named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's current ``state_dict`` (its keys, not the graph's). Under a plan whose
        ranks hold stale copies of what they do not run (``burst_parallel``), the copies are
        first brought up to date from their owners: a collective, every rank calls it."""
        refresh = getattr(self.executor.rank_program, "refresh_state", None)
        if refresh is not None:
            refresh(self.graph_module)
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load into the model (``nn.Module.load_state_dict``; in place, so what the
        compiled graph and its programs read changes with it)."""
        if assign:
            raise ValueError("Compiled.load_state_dict(assign=True) would replace the tensors "
                             "the compiled graph reads: load in place (assign=False)")
        return self.model.load_state_dict(state_dict, strict=strict)

    def runtime_state_dict(self) -> dict[str, Any]:
        """What the plan's program holds beside the model and the optimizer (tick_tock's
        second wave, compressor residuals, step counters), for a checkpoint beside
        :meth:`state_dict` and the optimizer's; ``{}`` when it holds nothing.

        Example:
            >>> import torch, tidal
            >>> c = tidal.compile(torch.nn.Linear(2, 2), (torch.randn(4, 2),))
            >>> c.runtime_state_dict()
            {}
        """
        save = getattr(self.executor.rank_program, "runtime_state", None)
        return {} if save is None else save(self.graph_module)

    def load_runtime_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`runtime_state_dict`'s result (after the model and the optimizer):
        the next step continues the saved training bit for bit."""
        load = getattr(self.executor.rank_program, "load_runtime_state", None)
        if load is None:
            if state:
                raise ValueError(f"Compiled.load_runtime_state_dict: this compile's program "
                                 f"({type(self.executor.rank_program).__name__}) holds no "
                                 f"runtime state, the checkpoint has {sorted(state)[:3]}")
            return
        load(self.graph_module, self.optimizer if self.context.optimizer is not None else None,
             state)

    @property
    def training(self) -> bool:
        """The model's ``training`` flag."""
        return self.model.training

    def train(self, mode: bool = True, *scheduled: Any, **options: Any) -> "ModuleFace":
        """Set the model's training mode (``nn.Module.train``); returns this object. A
        forward in another mode than the compile's runs the model traced in that mode."""
        if scheduled or options or not isinstance(mode, bool):
            raise TypeError(f"Compiled.train(mode) takes a bool, not {type(mode).__name__}: "
                            f"the scheduler's training entry point is Compiled.train_scheduled")
        self.model.train(mode)
        return self

    def eval(self) -> "ModuleFace":
        """``train(False)``."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients (``nn.Module.zero_grad``)."""
        self.model.zero_grad(set_to_none=set_to_none)
