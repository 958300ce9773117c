"""Hugging Face interop: configs (``config.py``), per-rank safetensors reads (``checkpoint.py``) and
``transformers``' own MoE blocks as references (``reference.py``)."""
