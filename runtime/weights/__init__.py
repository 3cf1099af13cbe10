"""Weights and memory: the on-disk weight store (``store``), its pipelined loader (``loader``),
which weights stay resident (``residency``) and device-memory probes (``memory_probe``)."""
