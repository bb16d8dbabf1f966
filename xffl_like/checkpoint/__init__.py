"""Checkpoints: Hugging Face safetensors import/export (``hf``)."""
