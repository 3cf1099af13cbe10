"""Fault injection on 2 gloo ranks (issue #35): ranks a step apart, a peer killed or stalled
during a step. Marked slow and kept few (one spawned job per case)."""
