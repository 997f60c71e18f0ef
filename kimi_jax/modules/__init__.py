"""Flax NNX modules of the Kimi family; one concept per file."""
