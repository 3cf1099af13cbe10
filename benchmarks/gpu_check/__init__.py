"""``make gpu-check``: one prepared run of tidal's CUDA paths on a GPU machine with no network.

Each check is a module here with ``run(device: str, quick: bool) -> dict`` of figures (and
``SUMMARY``: the figures the table shows); :mod:`benchmarks.gpu_check.driver` runs each in its
own subprocess with a time limit (``CHECKS``: name and seconds on a GPU), everything in at most
8 minutes, and writes one JSON line per check (``checks.jsonl``) and a markdown table
(``table.md``) into ``--out``. A check fails by raising, or by listing what is wrong in its
figures' ``"failures"``; the others still run, and the exit status is 1 after all of them.
``quick`` (the default on the CPU, ``make gpu-check DEVICE=cpu``, part of ``make test``) runs
the same code on tiny sizes, so the harness never breaks unseen.

    python -m benchmarks.gpu_check --device cuda --out gpu-check-out   # make gpu-check
    python -m benchmarks.gpu_check --device cpu --only ddp_hook         # one check, quick
"""
from __future__ import annotations

CHECKS: tuple[tuple[str, float], ...] = (
    ("environment", 30.0),
    ("train_step", 60.0),
    ("priority_runtime", 35.0),
    ("layer_loading", 35.0),
    ("task_switch", 90.0),
    ("chai_decode", 40.0),
    ("antman_cap", 45.0),
    ("ddp_hook", 25.0),
    ("capture_memory", 30.0),
    ("step_profile", 40.0),
    ("torch_compile", 120.0),
    ("cuda_tests", 180.0),
)
"""The checks in run order, each with its time limit in seconds (a check never gets more than
what is left of the total budget)."""

TOTAL_S = 480.0
"""Everything in at most 8 minutes."""

QUICK_S = 120.0
"""The time limit of every check in quick mode (tiny sizes: a few seconds each)."""
