"""The model around the MoE: attention with a KV cache, the decoder layer, and two-batch overlap
(``tbo.py``), which runs a decoder layer as two interleaved micro-batches."""
