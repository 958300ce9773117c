"""The model around the MoE: attention with a KV cache (``attention``), the decoder layer
(``decoder_layer``) and its split into two micro-batches (``micro_batches``), which two-batch overlap
(``overlap/tbo.py``) runs interleaved."""
