"""Cluster simulator: plans and schedules executed on a model of N GPUs with links.

``engine`` runs a task list (compute on one GPU, communication on the links of several) in
program order with dependencies, optionally with the compute lanes sharing a number of cores;
the textbook collective times are ``tidal.ir.comm_cost``'s; ``programs`` builds task lists for
execution strategies from per-layer costs and from the runtime's own ``Program`` objects
(``tidal.runtime.program``; the simulator imports ``ir`` and ``runtime``, which never import
it); ``collocation`` packs a background job into idle time; ``scenarios`` runs DeepPool's
Figure 9 cases; ``scaling`` the Figure 1 view.
"""
