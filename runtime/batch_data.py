"""Data as users shard it: the batch every rank's step runs on, under either convention.

Every rank program takes its share of dim 0 of one *global* batch. Users pass data in one of
two ways, chosen at compile (``tidal.compile(..., batch=)``, ``PassContext.batch``):

* ``"global"``: every rank passes the same global batch. With ``check`` and more than one rank,
  one small all-gather of a per-rank header (a hash of the batch's structure and of a float64
  fingerprint per tensor: element count, sum, sum of squares and a position-weighted sum of a
  strided sample) catches ranks whose batches differ, and a :class:`BatchError` names the input
  and the ranks. Every rank sees every header, so every rank raises: nothing hangs. A training
  step need not make that round: :func:`batch_check` gives the header's hash as a
  :class:`BatchCheck`, whose :meth:`BatchCheck.values` ride on a collective the step makes
  anyway (the loss all-reduce, ``tidal.runtime.programs.replica_sync.reduce_loss_async``); only
  when the sums say the ranks differ does :meth:`BatchCheck.mismatch` exchange what names the
  input and raise the same :class:`BatchError` (every rank sees the same sums, so every rank
  takes that branch). :meth:`BatchCheck.exchange` is the separate round, for a step without
  such a collective.
* ``"local"``: each rank passes its own local batch (a ``DistributedSampler``). The tensors are
  all-gathered along dim 0 in rank order into the global batch (local sizes exchanged first; a
  last, smaller batch is padded for the collective and trimmed), so the programs' sharding
  gives rank ``r`` its own rows again when the local sizes are equal. Values that are not
  tensors with a dim 0 (Python numbers, strings, 0-dim tensors) must be equal on every rank
  and are passed through.

Under both, a tensor input or target whose dim 0 is not the batch's (dim 0 of the first input
tensor) is a :class:`BatchError` naming it: tidal splits dim 0 over the ranks and never
replicates a tensor. Inputs and targets are any pytrees (``torch.utils._pytree``): a tuple or a
dict of keyword inputs, a tensor, tuple or dict of targets. With one rank (or no process group)
the arguments come back as they are, after the dim-0 check. Gathered tensors are detached.

Example:
    >>> import torch
    >>> from tidal.runtime.batch_data import BatchError, global_batch
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    >>> inputs, targets = global_batch((x,), y, "local")      # no process group: as given
    >>> inputs[0] is x and targets is y
    True
    >>> try:
    ...     global_batch({"input_ids": x}, y[:3], "global")
    ... except BatchError as e:
    ...     print(str(e).split(" (dim 0")[0])
    global_batch: targets has 3 rows in dim 0 but the batch has 4
"""
from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from tidal.ir.compat import all_gather_into_tensor
from tidal.ir.errors import TidalError
from tidal.ir.pass_api import BATCH_CONVENTIONS
from tidal.runtime.distributed import collective_device, group_size

SAMPLE = 4096
"""At most this many elements of a tensor enter the sample sums of its fingerprint."""

_FIX = ("pass the same global batch on every rank, or compile(..., batch='local') when each "
        "rank passes its own, as with DistributedSampler")

_LOCAL_FIX = ("with batch='local' the ranks' batches differ only in their rows: pass the same "
              "structure, dtypes, trailing shapes and non-tensor values on every rank")


class BatchError(TidalError, ValueError):
    """The batch a step was given cannot be the global batch: a tensor whose dim 0 is not the
    batch's, ranks whose global batches differ, or local batches that cannot be joined."""


@dataclass(frozen=True)
class Leaf:
    """One value of ``(inputs, targets)``: its ``name`` (``inputs[0]``, ``targets['y']``), the
    ``value`` and whether it is a tensor with a dim 0 (``rows``), which is split by rows."""

    name: str
    value: Any
    rows: bool


def _leaf_name(path: Sequence[Any]) -> str:
    """``inputs...``/``targets...`` for a pytree path of ``(inputs, targets)``.

    Example:
        >>> from torch.utils._pytree import SequenceKey, MappingKey
        >>> _leaf_name((SequenceKey(1), MappingKey("y")))
        "targets['y']"
    """
    return ("inputs", "targets")[path[0].idx] + keystr(tuple(path[1:]))


def batch_leaves(inputs: Any, targets: Any) -> tuple[list[Leaf], Any]:
    """The leaves of ``(inputs, targets)`` in pytree order and the tree's spec (a top-level
    mapping that pytree does not know, such as a ``BatchEncoding``, is read as a dict).

    Example:
        >>> import torch
        >>> leaves, _ = batch_leaves({"ids": torch.ones(2, 3)}, (torch.ones(2), 0.5))
        >>> [(x.name, x.rows) for x in leaves]
        [("inputs['ids']", True), ('targets[0]', True), ('targets[1]', False)]
    """
    as_tree = tuple(dict(v) if isinstance(v, Mapping) and not isinstance(v, dict) else v
                    for v in (inputs, targets))
    flat, spec = tree_flatten_with_path(as_tree)
    leaves = [Leaf(_leaf_name(path), v, isinstance(v, torch.Tensor) and v.dim() > 0)
              for path, v in flat]
    # an input tensor whose dim 0 is not the batch's is a value every sample shares (a
    # broadcast ``position_ids`` of one row): passed on as it is, never split nor joined
    first = next((x for x in leaves if x.rows and x.name.startswith("inputs")), None)
    return [Leaf(x.name, x.value, False) if x.rows and x.name.startswith("inputs") and
            x.value.shape[0] != first.value.shape[0] else x for x in leaves], spec


def rows_error(leaves: Sequence[Leaf], what: str) -> str:
    """Why the tensors of ``leaves`` do not share the batch's dim 0 (that of the first input
    tensor with a dim 0; ``what`` says which batch it is), or '' when they do. An input tensor
    with another dim 0 is a shared value (:func:`batch_leaves`); a target never is.

    Example:
        >>> import torch
        >>> rows_error(batch_leaves((torch.ones(4, 2),), torch.ones(4))[0], "the global batch")
        ''
        >>> rows_error(batch_leaves((torch.ones(4, 2),), torch.ones(1))[0], "the global batch")[:48]
        'targets has 1 rows in dim 0 but the batch has 4 '
    """
    first = next((x for x in leaves if x.rows and x.name.startswith("inputs")), None)
    for leaf in (x for x in leaves if x.rows):
        if first is None:
            return (f"{leaf.name} is a tensor but no input tensor has a dim 0 to give the "
                    f"batch; pass the inputs as tensors with the batch in dim 0")
        if leaf.value.shape[0] != first.value.shape[0]:
            return (f"{leaf.name} has {leaf.value.shape[0]} rows in dim 0 but the batch has "
                    f"{first.value.shape[0]} (dim 0 of {first.name}, {what}); every tensor "
                    f"input and target holds one row per sample, since tidal splits dim 0 over "
                    f"the ranks and never replicates a tensor: give it a leading batch "
                    f"dimension, or make it a module buffer or a Python value")
    return ""


def _local_rows(leaves: Sequence[Leaf]) -> int:
    """This rank's batch: dim 0 of the first tensor with one (0 when there is none)."""
    return next((int(x.value.shape[0]) for x in leaves if x.rows), 0)


class _Convention(enum.IntEnum):
    """The conventions as the header carries them."""

    GLOBAL = 0
    LOCAL = 1


def fingerprints(tensors: Sequence[torch.Tensor]) -> list[tuple[float, ...]]:
    """Per tensor, in float64: its element count, sum, and the sum of squares and
    position-weighted sum of a strided sample of at most :data:`SAMPLE` elements (so a
    reordered batch differs too). Deterministic: equal tensors give equal floats.

    Example:
        >>> import torch
        >>> a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> fingerprints([a, a.flip(0)])
        [(4.0, 10.0, 30.0, 30.0), (4.0, 10.0, 30.0, 22.0)]
    """
    out = []
    for t in tensors:
        flat = t.detach().resolve_conj().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        sample = flat[::max(1, flat.numel() // SAMPLE)].to(torch.float64)
        position = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=flat.device)
        out.append(torch.stack([flat.new_tensor(flat.numel(), dtype=torch.float64),
                                flat.sum(dtype=torch.float64), sample.square().sum(),
                                (sample * position).sum()]))
    if not out:
        return []
    return [tuple(row) for row in torch.nan_to_num(torch.stack(out)).cpu().tolist()]


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
         torch.Size, enum.Enum)


def _describe_value(value: Any, compare: bool) -> str:
    """How a leaf that is not split by rows is compared across ranks: plain Python values and
    0-dim tensors by value (when ``compare``), anything else by its type only."""
    if not compare:
        return type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return f"tensor({value.item()!r}, dtype={value.dtype})"
    if isinstance(value, _PLAIN):
        return repr(value)
    return f"a {type(value).__qualname__}"


def _describe(leaves: Sequence[Leaf], convention: _Convention, compare: bool) -> list[str]:
    """One string per leaf that equal batches share: under the global convention a tensor's
    dtype, shape and fingerprint; under the local one its dtype and shape past dim 0."""
    rows = [x.value for x in leaves if x.rows]
    prints = iter(fingerprints(rows) if convention is _Convention.GLOBAL and compare else ())
    out = []
    for leaf in leaves:
        if not leaf.rows:
            out.append(_describe_value(leaf.value, compare))
        elif convention is _Convention.LOCAL:
            out.append(f"{leaf.value.dtype} rows of shape (*, {tuple(leaf.value.shape[1:])})")
        else:
            count, total, squares, weighted = next(prints)
            out.append(f"{leaf.value.dtype} {tuple(leaf.value.shape)}, sum {total!r}, sample "
                       f"sums {squares!r}, {weighted!r} ({int(count)} elements)")
    return out


def _structure_hash(spec: Any, descriptions: Sequence[str]) -> int:
    """A 62-bit hash of the tree spec and the leaves' descriptions, equal on every process for
    equal arguments (``hashlib``, not Python's salted ``hash``)."""
    text = "\n".join([str(spec), *descriptions]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def _exchange(values: Sequence[int], group: Any) -> torch.Tensor:
    """Every rank's ``values`` (int64, the same count on each) as a ``(world, len)`` CPU
    tensor, in rank order: one all-gather on the group's device."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    out = mine.new_empty(group_size(group) * mine.numel())
    all_gather_into_tensor()(out, mine, group=group)
    return out.view(group_size(group), -1).cpu()


def _disagreement(report: tuple[str, list[tuple[str, str]]], spec: Any, group: Any) -> str:
    """After headers that differ (every rank takes this path together): every rank's
    ``(dim-0 error, [(leaf name, description)])`` all-gathered as objects, turned into one
    message naming the ranks and the leaves at fault."""
    reports: list[Any] = [None] * group_size(group)
    dist.all_gather_object(reports, (report, " ".join(str(spec).split())), group=group)
    errors = _grouped([rep[0] for rep, _ in reports])
    errors.pop("", None)
    if errors:
        return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {e}"
                         for e, r in errors.items())
    specs = _grouped([s for _, s in reports])
    if len(specs) > 1:
        shapes = "; ".join(f"ranks {r}: {s}" for s, r in specs.items())
        return f"the ranks pass differently structured batches ({shapes})"
    lines = []
    for i, (name, _) in enumerate(report[1]):
        seen = _grouped([rep[1][i][1] for rep, _ in reports])
        if len(seen) > 1:
            ranks = "; ".join(f"ranks {r}: {d}" for d, r in seen.items())
            lines.append(f"{name} differs across ranks ({ranks})")
    return "; ".join(lines) or "the ranks' batches differ"


def _grouped(per_rank: Sequence[str]) -> dict[str, list[int]]:
    """The ranks holding each distinct value, in order of first appearance.

    Example:
        >>> _grouped(["a", "b", "a"])
        {'a': [0, 2], 'b': [1]}
    """
    out: dict[str, list[int]] = {}
    for rank, value in enumerate(per_rank):
        out.setdefault(value, []).append(rank)
    return out


def _agree(leaves: list[Leaf], spec: Any, convention: _Convention, compare: bool,
          group: Any) -> torch.Tensor:
    """Exchange the headers (per rank, int64: the convention, whether its batch has a dim-0
    error, its rows, the hash of what must agree); raise the same :class:`BatchError` on
    every rank when a rank's batch has a dim-0 error or the ranks' batches differ where they
    must not. Returns the headers, ``(world, 4)``."""
    what = "the global batch" if convention is _Convention.GLOBAL else "this rank's local batch"
    return _Header(convention, rows_error(leaves, what), _local_rows(leaves),
                   tuple(x.name for x in leaves), tuple(_describe(leaves, convention, compare)),
                   spec).exchange(group)


@dataclass(frozen=True)
class _Header:
    """What a rank's batch must agree on: its ``convention``, its dim-0 ``error`` ('' for
    none), its ``rows``, each leaf's ``names`` and ``descriptions`` (:func:`_describe`) and
    the tree ``spec``."""

    convention: _Convention
    error: str
    rows: int
    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    spec: Any

    @property
    def digest(self) -> int:
        """The 62-bit hash of the spec and the descriptions (:func:`_structure_hash`)."""
        return _structure_hash(self.spec, self.descriptions)

    def exchange(self, group: Any) -> torch.Tensor:
        """The headers of every rank (one all-gather, ``(world, 4)``), raising the same
        :class:`BatchError` on every rank where they disagree (see :func:`_agree`)."""
        headers = _exchange((int(self.convention), int(bool(self.error)), self.rows,
                             self.digest), group)
        if (headers[:, 0] != headers[0, 0]).any():
            raise BatchError(f"global_batch: the ranks use different batch conventions "
                             f"({_grouped([BATCH_CONVENTIONS[int(c)] for c in headers[:, 0]])})"
                             f"; compile with the same batch= on every rank")
        if headers[:, 1].any() or (headers[:, 3] != headers[0, 3]).any():
            raise self.mismatch(group, named_error=bool(headers[:, 1].any()))
        return headers

    def mismatch(self, group: Any, named_error: bool = False) -> BatchError:
        """Once every rank knows the headers differ (a collective every rank makes, only
        then): the :class:`BatchError` naming the ranks and the leaves at fault
        (:func:`_disagreement`); ``named_error``: a rank's dim-0 error, which says its own
        fix."""
        why = _disagreement((self.error, list(zip(self.names, self.descriptions))), self.spec,
                            group)
        fix = _FIX if self.convention is _Convention.GLOBAL else _LOCAL_FIX
        return BatchError(f"global_batch ({BATCH_CONVENTIONS[int(self.convention)]} batches): "
                          f"{why}{'' if named_error else f'; {fix}'}")


HASH_BITS = 20
"""Each of the two values :meth:`BatchCheck.values` carries is this many bits of the header's
hash: ``world * sum(h ** 2)`` stays exact in float64 (below ``2 ** 53``) for any world below
``2 ** (53 - 2 * HASH_BITS)`` = 8192 ranks."""


@dataclass(frozen=True)
class BatchCheck:
    """A global batch's check across ranks, made by riding on a collective the step makes
    anyway instead of a round of its own (:func:`batch_check` makes one). The collective sums
    :meth:`values` over the ranks: two independent :data:`HASH_BITS`-bit values ``h`` of the
    header's hash and their squares; the ranks agree iff ``world * sum(h ** 2) == sum(h) **
    2`` for both (Cauchy-Schwarz: equality iff every rank's ``h`` is equal). Where they do
    not, every rank sees the same sums and calls :meth:`mismatch`, which names the input and
    the ranks. :meth:`exchange` is the check as a round of its own (on ``group``).

    Example:
        >>> import torch
        >>> check = batch_check((torch.ones(2, 3),), torch.zeros(2))   # no process group
        >>> check is None
        True
    """

    header: _Header
    group: Any = None
    """The process group of :meth:`exchange` (the batch exchange's)."""

    def values(self) -> list[float]:
        """``[h1, h1 ** 2, h2, h2 ** 2]``: integers below ``2 ** 40``, exact in float64."""
        mask = (1 << HASH_BITS) - 1
        h1, h2 = self.header.digest & mask, (self.header.digest >> HASH_BITS) & mask
        return [float(h1), float(h1 * h1), float(h2), float(h2 * h2)]

    def mismatch(self, group: Any) -> BatchError:
        """The :class:`BatchError` to raise on every rank of ``group`` once the sums of
        :meth:`values` say the ranks' batches differ (an all-gather naming the input at
        fault: every rank of ``group`` must call it)."""
        return self.header.mismatch(group)

    def exchange(self) -> None:
        """The check as a round of its own (one all-gather on :attr:`group`, as
        :func:`global_batch` makes it), for a step with no collective to ride on."""
        self.header.exchange(self.group)


def batch_check(inputs: Any, targets: Any, *, group: Optional[dist.ProcessGroup] = None
                ) -> Optional[BatchCheck]:
    """The check that every rank of ``group`` passed the same global batch ``(inputs,
    targets)``, without a collective now (:class:`BatchCheck`; None with one rank). A tensor
    whose dim 0 is not the batch's raises :class:`BatchError` here, on this rank: under the
    global convention every rank passes that same batch, so every rank raises.

    Example:
        >>> import torch
        >>> try:
        ...     batch_check((torch.ones(4, 2),), torch.ones(3))
        ... except BatchError as e:
        ...     print(str(e)[:48])
        global_batch: targets has 3 rows in dim 0 but th
    """
    leaves, spec = batch_leaves(inputs, targets)
    error = rows_error(leaves, "the global batch")
    if error:
        raise BatchError(f"global_batch: {error}")
    if group_size(group) == 1:
        return None
    return BatchCheck(_Header(_Convention.GLOBAL, "", _local_rows(leaves),
                              tuple(x.name for x in leaves),
                              tuple(_describe(leaves, _Convention.GLOBAL, True)), spec), group)


def _gathered_rows(tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: Any
                  ) -> list[torch.Tensor]:
    """``tensors`` (this rank's rows, ``sizes[rank]`` each) joined along dim 0 with every
    rank's, in rank order: the rows of every tensor packed as bytes into one buffer, padded to
    the largest local batch, one all-gather, trimmed and unpacked."""
    device, most = collective_device(group), max(sizes)
    parts = [t.detach().resolve_conj().resolve_neg().contiguous().to(device)
             .reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8) for t in tensors]
    widths = [p.shape[1] for p in parts]
    mine = torch.cat(parts, dim=1)
    if mine.shape[0] < most:
        mine = torch.cat([mine, mine.new_zeros(most - mine.shape[0], mine.shape[1])])
    everyone = mine.new_empty(len(sizes) * most, mine.shape[1])
    if everyone.numel():
        all_gather_into_tensor()(everyone, mine, group=group)
    joined = torch.cat([everyone[r * most:r * most + n] for r, n in enumerate(sizes)])
    out, offset = [], 0
    for t, width in zip(tensors, widths):
        block = joined[:, offset:offset + width].contiguous().view(t.dtype)
        out.append(block.reshape(joined.shape[0], *t.shape[1:]).to(t.device))
        offset += width
    return out


def global_batch(inputs: Any, targets: Any, convention: str, *, check: bool = True,
                 group: Optional[dist.ProcessGroup] = None) -> tuple[Any, Any]:
    """The global batch this step runs on, from what this rank passed (see the module
    docstring): ``(inputs, targets)`` as given under ``convention="global"`` (checked equal on
    every rank with ``check``), or every rank's local batch joined along dim 0 in rank order
    under ``"local"``. Raises :class:`BatchError` naming the input or target at fault (and the
    ranks) on every rank alike; ``ValueError`` for an unknown convention.

    Example:
        >>> import torch
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> inputs, targets = global_batch({"x": x}, {"y": torch.ones(3)}, "global")
        >>> inputs["x"] is x, targets["y"].shape
        (True, torch.Size([3]))
    """
    if convention not in BATCH_CONVENTIONS:
        raise ValueError(f"global_batch: convention {convention!r} is not one of "
                         f"{BATCH_CONVENTIONS}")
    leaves, spec = batch_leaves(inputs, targets)
    kind = _Convention(BATCH_CONVENTIONS.index(convention))
    if group_size(group) == 1 or (kind is _Convention.GLOBAL and not check):
        error = rows_error(leaves, f"the {convention} batch")
        if error:
            raise BatchError(f"global_batch: {error}")
        return inputs, targets
    headers = _agree(leaves, spec, kind, check, group)
    if kind is _Convention.GLOBAL:
        return inputs, targets
    rows = [i for i, x in enumerate(leaves) if x.rows]
    if not rows:
        return inputs, targets
    joined = _gathered_rows([leaves[i].value for i in rows], headers[:, 2].tolist(), group)
    values = [x.value for x in leaves]
    for i, tensor in zip(rows, joined):
        values[i] = tensor
    return tree_unflatten(values, spec)
