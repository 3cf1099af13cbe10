"""Random state kept across work that must consume none of it (warm-ups, captures, checks).

``torch.random.fork_rng(devices=[])`` forks only the CPU generator: on a GPU, the warm-ups and
the capture of a training step would advance the CUDA generator, and dropout in the steps that
follow would draw other numbers than eager PyTorch. :func:`fork_rng_of` forks the CPU generator
and the generator of every CUDA device the given values live on.

Example:
    >>> import torch
    >>> from tidal.ir.rng import fork_rng_of, cuda_indices
    >>> cuda_indices(torch.ones(2), [torch.zeros(1)], {"a": 3})
    []
    >>> _ = torch.manual_seed(0); a = torch.rand(1)
    >>> _ = torch.manual_seed(0)
    >>> with fork_rng_of(torch.ones(1)):
    ...     _ = torch.rand(5)
    >>> bool(torch.rand(1) == a)
    True
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_leaves


def cuda_indices(*values: Any) -> list[int]:
    """The sorted indices of the CUDA devices the tensors in ``values`` (any nesting of lists,
    tuples and dicts; modules count by their parameters and buffers) live on."""
    found: set[int] = set()
    for leaf in tree_leaves(values):
        tensors = ([*leaf.parameters(), *leaf.buffers()] if isinstance(leaf, torch.nn.Module)
                   else [leaf])
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                found.add(t.device.index if t.device.index is not None
                          else torch.cuda.current_device())
    return sorted(found)


@contextlib.contextmanager
def fork_rng_of(*values: Any) -> Iterator[None]:
    """Fork the CPU generator and those of the CUDA devices ``values`` live on (see the module
    docstring); on leaving, every one of them is as it was."""
    with torch.random.fork_rng(devices=cuda_indices(*values)):
        yield
