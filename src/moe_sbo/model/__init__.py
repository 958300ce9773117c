"""The model around the MoE: attention with a KV cache and the decoder layer two-batch overlap runs on."""
