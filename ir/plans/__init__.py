"""The plans passes emit, as data the runtime executes: one module per plan kind (frozen
dataclasses with ``to_json``/``from_json``, registered by kind name through
``tidal.ir.plan``). Nothing here imports a pass or the runtime."""
