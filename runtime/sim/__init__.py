"""Cluster simulator: plans and schedules executed on a model of N GPUs with links.

``engine`` runs a task list (compute on one GPU, communication on the links of several) in
program order with dependencies; ``collectives`` has the textbook collective times;
``programs`` builds task lists for execution strategies from per-layer costs.
"""
