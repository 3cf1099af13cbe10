"""Cluster simulator: plans and schedules executed on a model of N GPUs with links.

``engine`` runs the one Program type (``tidal.ir.program``) placed on the cluster (each piece on
the GPUs it occupies: compute on one, communication on the links of several) in program order
with dependencies, optionally with the compute lanes sharing a number of cores; the textbook
collective times are ``tidal.ir.comm_cost``'s; ``programs`` builds placed Programs for execution
strategies from per-layer costs (data parallelism by the same data-parallel schedule the runtime
builds, ``tidal.ir.program.data_parallel_program``) and places the runtime's own per-rank
``Program`` objects (``join_ranks``; the simulator imports ``ir`` and ``runtime``, which never
import it); ``collocation`` packs a background job into idle time; ``scenarios`` runs DeepPool's
Figure 9 cases; ``scaling`` the Figure 1 view.
"""
