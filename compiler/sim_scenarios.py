"""DeepPool's Figure 9 scenarios for a model: compile it with ``burst_parallel`` and simulate the
plan (``tidal.sim.scenarios.simulate_fig9``). Here, in ``compiler/``, because compiling is the
compiler's job: the simulator only runs what was compiled.

Example (tiny model, FLOP-derived times):
    >>> import torch, tidal
    >>> from tidal.compiler.sim_scenarios import fig9_scenarios
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> s = fig9_scenarios(model, (torch.randn(8, 64),), tidal.Cluster(gpus=2, peak_tflops=0.001))
    >>> sorted(s)
    ['bg_only', 'bp', 'bp_col', 'bp_col_sm', 'bp_overlap', 'dp', 'dp_planner', 'fallback', 'single']
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from tidal.compiler.api import compile as compile_model
from tidal.ir.cluster import Cluster
from tidal.ir.cost import example_batch
from tidal.sim.scenarios import simulate_fig9


def fig9_scenarios(model: torch.nn.Module, inputs: Sequence[Any], cluster: Cluster, *,
                   bg_batch: int = 8, interference: float = 1.1, leaf_modules=(),
                   **burst_options: Any) -> dict[str, Any]:
    """The scenarios of :func:`tidal.sim.scenarios.simulate_fig9` (simulated samples/s) for
    ``model`` at the inputs' global batch on ``cluster``. The plan is made under DeepPool's
    model of gradient sync, one all-reduce per layer (``burst_parallel(sync="paper")``), unless
    ``burst_options`` say otherwise; ``leaf_modules`` are kept whole when tracing."""
    burst_options = {"sync": "paper", **burst_options}  # DeepPool §4's planning model
    compiled = compile_model(model, inputs, passes=["burst_parallel"], cluster=cluster,
                             leaf_modules=leaf_modules, **burst_options)
    return simulate_fig9(compiled.graph_module, compiled.plan.get("burst_parallel"), cluster,
                         example_batch(inputs), bg_batch=bg_batch, interference=interference)
