"""Training loops and wrappers other than annot's own around an annot model:
Lightning's strategy, torch's data-parallel wrappers refused."""
