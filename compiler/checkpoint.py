"""Checkpoints of a compiled model through ``torch.distributed.checkpoint`` (DCP).

:func:`get_state_dict` and :func:`set_state_dict` have the semantics of DCP's own
(``torch.distributed.checkpoint.state_dict``), on the compiled model: the model's state is
brought up to date on every rank first (under ``burst_parallel`` a rank's copies of layers it
does not run are stale: ``Compiled.state_dict()`` refreshes them, a collective), and each
optimizer's state is keyed by parameter name. Save the result with ``dcp.save``: a state a
rank holds alone (burst's owner-only optimizer state) is saved from that rank, a replicated one
once, so the checkpoint is sharded by ownership and loads on any world size, one process
included (``dcp.load`` into a template from :func:`get_state_dict` or DCP's own, then
:func:`set_state_dict`).

What a plan's program holds beside the model and the optimizer (``Compiled.
runtime_state_dict()``: tick_tock's second wave and its optimizers, the gradient the next wave
averages with, compressor residuals and warm starts, step counters) goes into the same
``dcp.save`` through :func:`get_runtime_state_dict` and comes back through
:func:`set_runtime_state_dict`: entries equal on every rank under plain keys (saved once),
entries that differ under ``rank{r}`` keys (DCP keeps one copy of a key several ranks save, so
one key for per-rank state would silently keep one rank's). It resumes bit for bit on the same
world size; on another, per-rank state raises :class:`RuntimeStateError`.

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

import hashlib
import json
import os
import pickle
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tidal.compiler.owned_optimizer_state import every_ranks_groups, load_owned_state
from tidal.ir.errors import TidalError

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]
WORLD, SHARED, RANK_MARK = "world_size", "shared", "rank"
"""The runtime state's sections: the saving world size, the entries equal on every rank, and
the key every ``rank{r}`` section holds (so that the section is in the checkpoint even when
the rank has nothing of its own)."""


class RuntimeStateError(TidalError, ValueError):
    """A runtime state that cannot be restored here (another world size with per-rank state,
    a section missing)."""


def get_state_dict(compiled: Any, optimizers: Optimizers = (), **options: Any
                   ) -> tuple[dict[str, Any], Any]:
    """``(model state, optimizer state)`` of ``compiled`` (a ``Compiled``) and
    ``optimizers``, current on every rank (a collective under a plan that keeps stale copies:
    every rank calls it); ``options`` are DCP's ``StateDictOptions`` fields. Under a plan
    whose ranks own parameters (``burst_parallel``) a rank's optimizer state holds only what
    it owns: DCP fills an optimizer that has not stepped with a fresh step's state, and
    ``dcp.save`` keeps one rank's copy of a key, which could be that one."""
    compiled.state_dict()   # brings stale copies up to date (burst_parallel)
    model_state, optim_state = dcp_state.get_state_dict(
        compiled.model, optimizers, options=dcp_state.StateDictOptions(**options))
    for name in foreign_parameters(compiled):
        if isinstance(optim_state, dict) and isinstance(optim_state.get("state"), dict):
            optim_state["state"].pop(name, None)
    if plan_owns_parameters(compiled) and isinstance(optim_state, dict):
        every_ranks_groups(optim_state, compiled.model)   # the same groups saved by every rank
    return model_state, optim_state


def plan_owns_parameters(compiled: Any) -> bool:
    """Whether ``compiled`` runs on several ranks under a plan whose ranks own parameters
    (the same answer on every rank)."""
    return getattr(compiled.executor.rank_program, "foreign", None) is not None and \
        rank_and_world()[1] > 1


def foreign_parameters(compiled: Any) -> list[str]:
    """The model's names of the parameters this rank does not own (its plan's program says;
    none on one process or under a plan where every rank holds everything)."""
    foreign = getattr(compiled.executor.rank_program, "foreign", None)
    if foreign is None or rank_and_world()[1] == 1:
        return []
    gm = compiled.graph_module
    graph_params = dict(gm.named_parameters(remove_duplicate=False))
    ids = {id(graph_params[n]) for n in foreign(gm) if n in graph_params}
    return [n for n, p in compiled.model.named_parameters() if id(p) in ids]


def set_state_dict(compiled: Any, optimizers: Optimizers = (), *, model_state_dict: Any,
                   optim_state_dict: Any, **options: Any) -> Any:
    """Load ``model_state_dict`` and ``optim_state_dict`` (from :func:`get_state_dict`, as
    ``dcp.load`` filled them) into ``compiled``'s model, in place, and ``optimizers``. The
    optimizer of a rank that owns parameters (``burst_parallel``) is loaded by
    ``tidal.compiler.owned_optimizer_state.load_owned_state`` (DCP refuses a group this rank
    holds none of)."""
    if plan_owns_parameters(compiled) and isinstance(optimizers, torch.optim.Optimizer):
        result = dcp_state.set_model_state_dict(
            compiled.model, model_state_dict, options=dcp_state.StateDictOptions(**options))
        load_owned_state(optimizers, compiled.model, optim_state_dict)
        return result
    return dcp_state.set_state_dict(compiled.model, optimizers,
                                    model_state_dict=model_state_dict,
                                    optim_state_dict=optim_state_dict,
                                    options=dcp_state.StateDictOptions(**options))


def get_runtime_state_dict(compiled: Any, *, checkpoint_id: Any = None,
                           key: str = "runtime") -> dict[str, Any]:
    """``compiled.runtime_state_dict()`` as a dict for ``dcp.save`` (a collective on several
    ranks: every rank calls it): ``{"world_size": N, "shared": {...}, "rank{r}": {...}}``,
    the nested state flattened to one level (keys: the JSON of each entry's path), an entry
    under ``shared`` when it is equal on every rank (bit for bit), under this rank's section
    otherwise. On one process every entry is this rank's (nothing shows it replicated).

    With ``checkpoint_id`` (a DCP checkpoint directory or ``StorageReader``), the template to
    ``dcp.load`` into instead: this rank's entries of the checkpoint's ``key`` (the key the
    runtime state was saved under), tensors of the saved shapes and dtypes on ``compiled``'s
    device. It raises :class:`RuntimeStateError` when the checkpoint was saved on another world
    size and holds per-rank entries (compressor residuals: resume on the same world size, or
    leave the runtime state out and start it fresh).

    Example:
        >>> import torch, tidal
        >>> from tidal.compiler.checkpoint import get_runtime_state_dict
        >>> c = tidal.compile(torch.nn.Linear(2, 2), (torch.randn(4, 2),))
        >>> get_runtime_state_dict(c)
        {'world_size': 1, 'shared': {}, 'rank0': {'rank': 0}}
    """
    rank, world = rank_and_world()
    if checkpoint_id is not None:
        return runtime_template(checkpoint_id, key, compiled_device(compiled))
    flat: dict[str, Any] = {}
    state = compiled.runtime_state_dict()
    if state:
        flatten(state, [], flat)
    shared = replicated_keys(flat, world)
    return {WORLD: world, SHARED: {k: v for k, v in flat.items() if k in shared},
            f"rank{rank}": {RANK_MARK: rank,
                            **{k: v for k, v in flat.items() if k not in shared}}}


def set_runtime_state_dict(compiled: Any, state: dict[str, Any]) -> None:
    """Restore :func:`get_runtime_state_dict`'s dict (as ``dcp.load`` filled its template)
    into ``compiled``, after the model and the optimizers: the next step continues the saved
    training bit for bit. Per-rank entries saved on another world size raise
    :class:`RuntimeStateError`.

    Example:
        >>> import torch, tidal
        >>> from tidal.compiler import checkpoint
        >>> c = tidal.compile(torch.nn.Linear(2, 2), (torch.randn(4, 2),))
        >>> checkpoint.set_runtime_state_dict(c, checkpoint.get_runtime_state_dict(c))
    """
    rank, world = rank_and_world()
    own = {k: v for k, v in state.get(f"rank{rank}", {}).items() if k != RANK_MARK}
    saved_world = state.get(WORLD, world)
    if saved_world != world and own:
        raise RuntimeStateError(
            f"tidal.checkpoint.set_runtime_state_dict: the runtime state was saved on "
            f"{saved_world} ranks and rank {rank} has per-rank entries ({sorted(own)[:2]}...); "
            f"this run has {world}: resume on {saved_world} ranks or leave it out")
    flat = {**state.get(SHARED, {}), **own}
    compiled.load_runtime_state_dict(unflatten(flat) if flat else {})


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 with no process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def compiled_device(compiled: Any) -> torch.device:
    """Where ``compiled``'s parameters live (the CPU when it has none)."""
    first = next(iter(compiled.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def flatten(obj: Any, path: list, out: dict[str, Any]) -> None:
    """``obj``'s leaves into ``out`` under the JSON of their path: a dict key as itself (str or
    int), a list index ``i`` as ``[i]``; an empty dict or list is the leaf ``dict``/``list``
    (the type), a dict with other keys and anything else (tuples too) a leaf DCP pickles."""
    if isinstance(obj, dict) and obj and all(isinstance(k, (str, int)) for k in obj):
        for k, v in obj.items():
            flatten(v, path + [k], out)
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            flatten(v, path + [[i]], out)
    elif isinstance(obj, (dict, list)) and not obj:
        out[json.dumps(path)] = list if isinstance(obj, list) else dict
    else:
        out[json.dumps(path)] = obj


def unflatten(flat: dict[str, Any]) -> Any:
    """The nested state :func:`flatten` flattened."""
    return build([(json.loads(k), v) for k, v in flat.items()])


def build(entries: list[tuple[list, Any]]) -> Any:
    """The value of ``entries`` (paths relative to it, and leaves)."""
    if len(entries) == 1 and not entries[0][0]:
        leaf = entries[0][1]
        return leaf() if leaf is dict or leaf is list else leaf
    groups: dict[Any, list] = {}
    for path, leaf in entries:
        head = (path[0][0],) if isinstance(path[0], list) else path[0]
        groups.setdefault(head, []).append((path[1:], leaf))
    if all(isinstance(h, tuple) for h in groups):
        return [build(groups[(i,)]) for i in range(len(groups))]
    return {h: build(sub) for h, sub in groups.items()}


def digest(value: Any) -> str:
    """A hash of ``value``'s bits (a tensor's dtype, shape and bytes; anything else pickled)."""
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(pickle.dumps(value))
    return h.hexdigest()


def replicated_keys(flat: dict[str, Any], world: int) -> set[str]:
    """The keys of ``flat`` whose values are equal (bit for bit) on every rank (one small
    all-gather of hashes); none on one process."""
    if world == 1:
        return set()
    mine = {k: digest(v) for k, v in flat.items()}
    everyone: list[Optional[dict[str, str]]] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {k for k, d in mine.items() if all(o.get(k) == d for o in everyone)}


def runtime_template(checkpoint_id: Any, key: str, device: torch.device) -> dict[str, Any]:
    """This rank's part of the runtime state saved under ``key`` in the checkpoint, with
    tensors of the saved shapes and dtypes (on ``device``) and ``None`` for pickled entries,
    for ``dcp.load`` to fill (see :func:`get_runtime_state_dict`)."""
    reader = (FileSystemReader(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike))
              else checkpoint_id)
    prefix = key + "."
    sections: dict[str, Any] = {}
    for fqn, meta in reader.read_metadata().state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        section, _, name = fqn[len(prefix):].partition(".")
        value = (None if isinstance(meta, BytesStorageMetadata)
                 else torch.empty(meta.size, dtype=meta.properties.dtype, device=device))
        if name:
            sections.setdefault(section, {})[name] = value
        else:
            sections[section] = value
    if WORLD not in sections:
        raise RuntimeStateError(f"tidal.checkpoint.get_runtime_state_dict: the checkpoint "
                                f"{checkpoint_id!r} has no runtime state under {key!r} (its "
                                f"key in the dict given to dcp.save)")
    return keep_this_rank(sections, checkpoint_id)


def keep_this_rank(sections: dict[str, Any], checkpoint_id: Any) -> dict[str, Any]:
    """``sections`` less the other ranks' (see :func:`runtime_template`)."""
    rank, world = rank_and_world()
    ranks = sorted(int(s[4:]) for s in sections if s.startswith("rank"))
    per_rank = [r for r in ranks if set(sections[f"rank{r}"]) - {RANK_MARK}]
    if per_rank and ranks != list(range(world)):
        raise RuntimeStateError(
            f"tidal.checkpoint.get_runtime_state_dict: the checkpoint {checkpoint_id!r} holds "
            f"per-rank runtime state of ranks {ranks} (compressor residuals, ...) and this run "
            f"has {world} ranks: resume on {len(ranks)} ranks, or leave the runtime state out "
            f"of the load (the program starts it fresh)")
    template = {k: v for k, v in sections.items() if not k.startswith("rank")}
    if f"rank{rank}" in sections and ranks == list(range(world)):
        template[f"rank{rank}"] = sections[f"rank{rank}"]
    return template
