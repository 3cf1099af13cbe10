"""Bagpipe's runtime (dissertation ch. 5): an Oracle Cacher looking ahead over future batches
to prefetch and cache embedding rows with a TTL, LRPP caches with delayed synchronization on
the trainers, sharded embedding servers, over torch.distributed.rpc and gloo.

Modules: ``oracle`` (the pure lookahead and LRU planners), ``cache`` (a trainer's table
cache), ``server`` (the embedding server), ``trainer`` (the training loop), ``launch``
(processes, checkpoints), ``faults`` (which process failed: reports, blame), ``stats``,
``errors``.

Example:
    >>> from tidal.runtime.bagpipe import Lookahead
    >>> o = Lookahead(trainers=2, lookahead=1, stop=1)
    >>> d0, = o.feed(0, [{1, 2}, {2}])
    >>> d0.local, d0.fetch
    (((1,), ()), ((1, 2), (2,)))
"""
from tidal.runtime.bagpipe.cache import TableCache
from tidal.runtime.bagpipe.errors import BagpipeError, BagpipePeerFailure
from tidal.runtime.bagpipe.launch import Result, RunSpec, load_checkpoint, train, train_many
from tidal.runtime.bagpipe.oracle import LruPlanner, Lookahead, TableDecision
from tidal.runtime.bagpipe.server import EmbeddingServer
from tidal.runtime.bagpipe.stats import IterationStats

__all__ = ["BagpipeError", "BagpipePeerFailure", "EmbeddingServer", "IterationStats",
           "Lookahead", "LruPlanner", "Result", "RunSpec", "TableCache", "TableDecision",
           "load_checkpoint", "train", "train_many"]
