"""The forward of a burst-parallel rank: this rank's graph of the plan for each batch, and the
plan run on it (``tidal.runtime.programs.burst`` holds the rank program that calls it).

Every rank passes the same global batch. The rank's graph (``burst_graph.rank_graph``) skips
the layers the rank does not run and carries what each transfer must move; it is built once per
graph, input shapes and dtypes and autocast state, when the ranks check that they bind the same
kind of step (``burst_transfers.agree``, a collective). A batch other than the plan's — a last,
smaller batch — runs the plan's structure, each layer on the same ranks, with that batch's
samples split among each layer's ranks as ``torch.tensor_split`` splits them; a rank left no
rows of a layer skips it for that batch (``burst_batch``). Under ``compile(batch="local")``
each rank passes its own rows: :meth:`RankForward.run_local` joins them into the global batch,
runs the plan and returns this rank's rows. Without a process group (one process) the forward
is the graph itself.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.programs.burst_layout import BurstSpec
    >>> gm = fx.symbolic_trace(torch.nn.Linear(3, 2))
    >>> forwards = RankForward(BurstSpec(world=1, batch=4, param_ranks={}), checked=lambda: None)
    >>> forwards.batch_rows((torch.randn(6, 3),)), forwards.batch_rows(())
    (6, 4)
    >>> forwards.run(gm, (torch.randn(4, 3),), {}).shape      # one process: the graph itself
    torch.Size([4, 2])
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_map

from tidal.runtime.batch_data import global_batch
from tidal.runtime.distributed import is_distributed
from tidal.runtime.programs.burst_batch import batch_graph, layer_ranks_at
from tidal.runtime.programs.burst_graph import RankGraph, rank_graph
from tidal.runtime.programs.burst_layout import BurstSpec
from tidal.runtime.programs.burst_transfers import TransferChecker, agree
from tidal.runtime.programs.step_capture import shape_key


class RankForward:
    """The forward of the burst plan ``spec`` on this rank (see the module docstring): the
    rank graphs of the latest graph, by input key. ``checked()`` runs the program's checks
    before a distributed forward (the plan against the job; a collective the first time) and
    returns the process group the ranks agree on."""

    def __init__(self, spec: BurstSpec, checked: Callable[[], Optional[dist.ProcessGroup]]):
        self.spec = spec
        self.checked = checked
        self.graphs: Optional[tuple[fx.GraphModule, dict[tuple, RankGraph]]] = None
        """The graph the rank graphs are of, and its rank graphs by input key."""

    def batch_rows(self, inputs: tuple) -> int:
        """The global batch of ``inputs``: dim 0 of the first tensor (the plan's batch when
        there is none)."""
        first = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
        return self.spec.batch if first is None or first.dim() == 0 else int(first.shape[0])

    def local_graph(self, gm: fx.GraphModule, inputs: tuple,
                    comm_group: Optional[dist.ProcessGroup]) -> RankGraph:
        """``gm`` specialised for this rank, its skipped layers of the dtype they give on
        ``inputs`` under this thread's autocast state, and what each transfer must carry
        (``burst_graph.rank_graph``): built once per graph, input shapes and dtypes and
        autocast state, when the ranks check on ``comm_group`` that they bind the same kind
        of step (``burst_transfers.agree``, a collective). On another global batch than the
        plan's, the transfers move that batch's rows, each layer's ranks splitting it as
        ``torch.tensor_split`` does (``burst_batch``; a rank with no rows of a layer skips
        it)."""
        if self.graphs is None or self.graphs[0] is not gm:
            self.graphs = (gm, {})
        key = shape_key(inputs)
        graphs = self.graphs[1]
        if key not in graphs:
            spec = self.spec
            rows, source, ranks = self.batch_rows(inputs), gm, spec.layer_ranks
            if rows != spec.batch:
                source = batch_graph(gm, rows)
                ranks = layer_ranks_at(gm, spec.layer_ranks, spec.world, rows)
            local = rank_graph(source, ranks, dist.get_rank(), spec.unit_members, inputs,
                               key[-1])
            agree(key, comm_group)
            graphs[key] = local
        return graphs[key]

    def run(self, gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """The plan's forward on the global batch ``args``/``kwargs`` (one process: ``gm``),
        each transfer's input checked (``burst_transfers.TransferChecker``)."""
        if not is_distributed():
            return gm(*args, **kwargs)
        local = self.local_graph(gm, args, self.checked())
        if kwargs:
            return local.module(*args, **kwargs)
        return TransferChecker(local.module, local.expected, dist.get_rank()).run(*args)

    def run_local(self, gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any],
                  group: Optional[dist.ProcessGroup] = None, check: bool = True) -> Any:
        """The forward under ``compile(batch="local")`` (each rank passes its own rows): the
        ranks' inputs joined along dim 0 in rank order into the global batch
        (``tidal.runtime.batch_data.global_batch`` on ``group``; ``check`` as there), the plan
        run on it (:meth:`run`), and this rank's rows of each output tensor whose dim 0 is the
        global batch's (any other output comes back whole, the same on every rank). One
        process: the forward on the inputs as they are."""
        if not is_distributed():
            return self.run(gm, args, kwargs)
        mine = self.batch_rows(tuple(args) + tuple(kwargs.values()))
        # a row per input row naming its rank: joined with the inputs, it says where ours are
        rank = dist.get_rank()
        (args, kwargs), owners = global_batch((tuple(args), dict(kwargs)),
                                              torch.full((mine,), rank), "local",
                                              check=check, group=group)
        total, lo = owners.shape[0], int((owners < rank).sum())
        out = self.run(gm, args, kwargs)
        return tree_map(lambda t: t[lo:lo + mine] if isinstance(t, torch.Tensor) and t.dim()
                        and t.shape[0] == total else t, out)
