"""Gradients made whole after the backward: tp and tied-weight reductions, the
dp average overlapped with the backward, FSDP2 sharding over dp."""
