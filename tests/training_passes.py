"""The training passes on one process, by name: what a test compiles a small model with to
compare each pass (and no pass) against plain PyTorch."""
from tidal.passes.burst_parallel import BurstParallel
from tidal.passes.compression import CompressionPass
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock

TRAINING_PASSES = {
    "none": lambda: [],
    "compression": lambda: [CompressionPass("none")],   # the plain all-reduce
    "burst_parallel": lambda: [BurstParallel()],
    "tick_tock": lambda: [TickTock(ranks=1)],
    "round_robin": lambda: [RoundRobin(partitions=2)],
}
"""Pass name -> a factory of the ``passes=`` list for ``tidal.compile``."""
