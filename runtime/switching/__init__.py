"""PipeSwitch-style fast task switching on one device: a controller with a memory daemon
(:class:`Arena`), one active and standby worker processes, pipelined weight transmission from
host memory, and AntMan's arena-enforced memory caps (a job over its cap spills outside the
arena and runs on).

Modules: ``arena`` (the one device block and its leases), ``stack`` (a worker's stack-wise
carving, cap, spills past it), ``host_model`` (host copies in shared memory, page-locked per
process), ``job`` (what runs), ``task`` (a job inside a worker), ``worker`` (the worker
process), ``switcher`` (the controller), ``device`` (the indexed device, what moves to and off
it), ``messages`` (what crosses between processes, checked in the sender), ``errors``.

Example:
    >>> from tidal.runtime.switching import Arena
    >>> Arena(1000).capacity
    1024
"""
from tidal.runtime.switching.arena import Arena, Lease
from tidal.runtime.switching.errors import SwitchingError
from tidal.runtime.switching.host_model import HostModel
from tidal.runtime.switching.job import Repeat, SwitchJob, weightless
from tidal.runtime.switching.stack import ArenaStack
from tidal.runtime.switching.switcher import JobState, Output, Switch, Switcher
from tidal.runtime.switching.task import StepResult, Task

__all__ = ["Arena", "ArenaStack", "HostModel", "JobState", "Lease", "Output", "Repeat",
           "StepResult", "Switch", "SwitchJob", "Switcher", "SwitchingError", "Task",
           "weightless"]
