"""Hugging Face interop: configs (``config.py``), per-rank safetensors reads (``checkpoint.py``, put
into ``MoEWeights`` by ``assembly.py``) and ``transformers``' own MoE blocks as references
(``reference.py``)."""
