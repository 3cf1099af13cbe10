"""CHAI decoding: clustered-head attention at generation time, through Hugging Face ``generate``
(``cache``: the clustered K cache; ``generate``: ``compiled.generate``) or tidal's own decoder
(``decode``); the transformers version differences (``hf_compat``) and the offline SmolLM2
loader (``smollm2``)."""
