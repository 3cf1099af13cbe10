"""Runtime: backends (CPU, CUDA), lowering to captured segments, the program interpreter, the
multi-job scheduler (``scheduler``, its parts in ``scheduling``) and distributed launch.
``tidal.runtime.Runtime(device).submit(job, ...)``.
"""


def __getattr__(name: str):
    if name == "Runtime":  # lazy: importing tidal.runtime does not load the scheduler
        from tidal.runtime.scheduler import Runtime

        return Runtime
    raise AttributeError(f"module 'tidal.runtime' has no attribute {name!r}")
