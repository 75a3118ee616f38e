"""Building blocks of `lightllm.tools.make_tiny_model`: sizes, configs, tokenizer and weights of tiny checkpoints."""
