"""Communication and compression: gradient compressors (``compressors``), the DDP communication
hooks that run them (``ddp_hooks``) and their equivalence check (``ddp_check``), gradient sync
of the program builders (``grad_sync``), Accordion's regime switching (``accordion``) and the
link measurement behind the performance model (``link_fit``)."""
