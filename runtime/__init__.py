"""Runtime: backends (CPU, CUDA), lowering to captured segments, the multi-job scheduler,
distributed launch and the cluster simulator. ``tidal.runtime.Runtime(device).submit(job, ...)``.
"""


def __getattr__(name: str):
    if name == "Runtime":  # lazy: the scheduler imports tidal.compiler
        from tidal.runtime.scheduler import Runtime

        return Runtime
    raise AttributeError(f"module 'tidal.runtime' has no attribute {name!r}")
