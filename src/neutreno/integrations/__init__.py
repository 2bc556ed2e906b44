"""Bridges to other libraries (Hugging Face)."""
