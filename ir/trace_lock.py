"""The one lock that tidal's tracing and module runs hold, so ``tidal.compile`` may be called
from several threads.

Tracing with ``torch.fx`` (and ``torch.export`` / ``make_fx``, which trace with it) patches
``torch.nn.Module.__call__`` and ``__getattr__`` *process-wide* while it runs: a module called
by any other thread in that window is routed into that tracer and fails ("module is not
installed as a submodule") or is recorded into the wrong graph. A process-wide patch needs a
process-wide lock, so this module holds one module-level re-entrant lock (re-entrant because
``compile`` holds it around ``trace``, the cost model and passes that trace again). Every tidal
function that traces or runs a model's modules at compile time takes it (``ir.capture.trace``,
``ir.export_capture.export_trace``, ``ir.cost.annotate``, ``tidal.compile``). Modules a user runs
in another thread while a compile traces are not protected (as with ``torch.fx`` itself).

Example:
    >>> import threading
    >>> from tidal.ir.trace_lock import tracing
    >>> with tracing():
    ...     with tracing():            # re-entrant: a trace inside a compile
    ...         inner = True
    >>> inner
    True
"""
from __future__ import annotations

import threading

_LOCK = threading.RLock()


def tracing() -> threading.RLock:
    """The process-wide tracing lock, to use as ``with tracing(): ...`` around anything that
    traces (fx, ``torch.export``, ``make_fx``) or runs a model's modules at compile time."""
    return _LOCK
