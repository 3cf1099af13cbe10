"""What ``tick_tock`` (``tidal.runtime.programs.tick_tock``) checks of what it is given: a
global batch that cuts into 2 x ranks equal shards (:func:`check_wave_batch`: Lemma 1 holds
only over equal shards) and a checkpoint's kept tock gradient (:func:`named_prev_tock`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.fx as fx

from tidal.ir.cost import example_batch
from tidal.ir.param_owners import trainable
from tidal.runtime.batch_data import BatchError


def check_wave_batch(inputs: Any, world: int) -> None:
    """Raise :class:`~tidal.runtime.batch_data.BatchError` naming tick_tock, the batch and what
    it needs unless the global batch ``inputs`` cuts into 2 x ``world`` equal shards: Eq. 1
    averages a tick and a tock gradient of consecutive steps with equal weights, the mean over
    2N shards (Lemma 1) only when the shards are equal. No collective: every rank raises alike.

    Example:
        >>> import torch
        >>> check_wave_batch((torch.zeros(8, 3),), world=2)
        >>> try:
        ...     check_wave_batch((torch.zeros(7, 3),), world=2)
        ... except BatchError as e:
        ...     print(str(e).split(":")[1].strip())
        the global batch size 7 is not divisible by 2 x ranks = 4
    """
    batch, shards = example_batch(inputs), 2 * world
    if batch % shards:
        raise BatchError(
            f"tick_tock: the global batch size {batch} is not divisible by 2 x ranks = "
            f"{shards}: a step cuts it into one shard per rank and wave, and Eq. 1 averages "
            f"the tick and tock waves' gradients (of consecutive steps) with equal weights, "
            f"which is the gradient of the batches' mean loss only over equal shards; pass a "
            f"multiple of {shards} rows: drop the last, smaller batch "
            f"(DataLoader(drop_last=True)) or pad it, or train it without tick_tock")


def named_prev_tock(gm: fx.GraphModule, prev: Any) -> Optional[dict[str, torch.Tensor]]:
    """A checkpoint's ``prev_tock`` (the tock gradient the next tick averages with) by
    parameter name, copied: a dict as saved, or an older checkpoint's list, one gradient per
    trainable parameter of ``gm`` in order (the trainable set then and now must agree: a
    list of another length or shapes is refused, naming it).

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> sorted(named_prev_tock(m, [torch.ones(1, 2), torch.ones(1)]))
        ['bias', 'weight']
        >>> _ = m.bias.requires_grad_(False)
        >>> try:
        ...     named_prev_tock(m, [torch.ones(1, 2), torch.ones(1)])
        ... except ValueError as e:
        ...     print(str(e)[:66])
        tick_tock: the checkpoint's runtime state 'prev_tock' holds 2 grad
    """
    if prev is None:
        return None
    if isinstance(prev, Mapping):
        return {n: g.clone() for n, g in prev.items()}
    params = trainable(gm)
    if [tuple(g.shape) for g in prev] != [tuple(p.shape) for p in params.values()]:
        raise ValueError(
            f"tick_tock: the checkpoint's runtime state 'prev_tock' holds {len(prev)} "
            f"gradients by position (an older checkpoint), which do not match the "
            f"{len(params)} parameters the model trains now ({list(params)[:3]}, by count or "
            f"shape): load it with the parameters frozen or trained as when it was saved, "
            f"then change requires_grad")
    return {n: g.clone() for n, g in zip(params, prev)}
