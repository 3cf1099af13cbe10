"""The training passes on one process, by name: what a test compiles a small model with to
compare each pass (and no pass) against plain PyTorch; and the small model of the
training-loop tables (``LoopNet``)."""
import torch

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


class LoopNet(torch.nn.Module):
    """Three Linear layers with a Dropout (``drop``) between the first two; with ``buffer``,
    a counter and an average of the inputs updated in place in forward."""

    def __init__(self, drop: float = 0.5, buffer: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                  torch.nn.Linear(16, 3))
        self.drop = torch.nn.Dropout(drop)
        self.buffer = buffer
        if buffer:
            self.register_buffer("count", torch.zeros(()))
            self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        if self.buffer:
            self.count.add_(1)
            self.ema.mul_(0.9).add_(x.mean(0) * 0.1)
        return self.c(torch.relu(self.b(self.drop(torch.relu(self.a(x))))))
