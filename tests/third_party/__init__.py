"""The third-party model matrix: models nobody here wrote (Hugging Face classes from small
configs, plain ``torch.nn`` models) under every pass (issue #16 item 4)."""
