"""Fault injection on 2 gloo ranks (issue #35): ranks a step apart and bad batches
(``test_rank_faults``), a peer killed or stalled under each training pass and a checkpoint
written before the faults resumed (``test_peer_faults``, under torchrun). Marked slow and kept
few: every job is 2 ranks' start-up, and every stall a process group's timeout."""
