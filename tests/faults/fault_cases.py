"""What the fault tests share: the model each training pass compiles on 2 ranks, faults
injected where a rank's next step begins, and what a step raised as one line of text.

Example:
    >>> c, x, y = compiled("compression")
    >>> float(c.step((x,), y)) > 0
    True
    >>> outcome(lambda: c.step((x,), y))[:9]
    'no error '
"""
import os
import time

import torch

import tidal
from tidal.passes.burst_parallel import BurstParallel
from tidal.passes.compression import CompressionPass
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock

PG_TIMEOUT_S = 5.0
"""The process group's timeout in every fault job: a stalled peer fails a collective after it."""

TRAINING_PASSES = {
    "compression": lambda world: [CompressionPass("topk:0.5")],
    "burst_parallel": lambda world: [BurstParallel()],
    "tick_tock": lambda world: [TickTock(ranks=world)],
    "round_robin": lambda world: [RoundRobin(partitions=world)],
}
"""The four training passes, by name: ``world`` (the number of ranks) -> the passes."""


def compiled(name, world=2, x=None, y=None, **options):
    """A 3-layer MLP compiled under training pass ``name`` for ``world`` ranks with a
    cross-entropy loss and SGD with momentum (so the optimizer has state), and its batch
    (8 rows unless ``x``/``y`` are given): ``(compiled, x, y)``. The same weights and data
    on every call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) if x is None else x
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2)) if y is None else y
    c = tidal.compile(model, (x,), passes=TRAINING_PASSES[name](world), example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), **options)
    return c, x, y


def fault_at_next_bind(c, fault):
    """The next step of ``c`` on this rank runs ``fault`` where it begins (its rank program's
    ``bind``, after the batch check every rank made), then binds as usual."""
    program = c.executor.rank_program
    bind = program.bind

    def faulty(*args, **kwargs):
        del program.bind
        fault()
        return bind(*args, **kwargs)
    program.bind = faulty


def wait_for(path, at_most_s=60.0):
    """Sleep until the file ``path`` exists (at most ``at_most_s`` seconds)."""
    give_up = time.monotonic() + at_most_s
    while not os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.05)


def outcome(action):
    """What ``action()`` raised as ``'TYPE PASS|PIECE|SECONDS|MESSAGE'`` (``pass_name`` and
    ``piece`` of the error, '' where it has none; the seconds it took), or ``'no error
    |||SECONDS|'``."""
    start = time.monotonic()
    try:
        action()
        kind, pass_name, piece, message = "no error", "", "", ""
    except Exception as e:   # noqa: BLE001 - the caller checks what the step raised
        kind, message = type(e).__name__, str(e)
        pass_name, piece = getattr(e, "pass_name", ""), getattr(e, "piece", "")
    return f"{kind} {pass_name}|{piece}|{time.monotonic() - start:.1f}|{message}"


def write_atomically(path, text):
    """``text`` into the file ``path``, whole or not at all (a reader polls for it)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
