"""Checkpoint formats read as data: GGUF files, sentence-transformers metadata, the hub cache."""
