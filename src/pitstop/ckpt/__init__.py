"""Checkpoint backends: one module per backend."""
