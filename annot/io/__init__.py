"""Weights in and out: sharded checkpoints through DCP (resumable on any mesh),
Hugging Face checkpoints read by parts and written back in their layout."""
