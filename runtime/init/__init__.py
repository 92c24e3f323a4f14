"""Deferred initialization: a model built on the meta device gets this rank's
slice of the initial weights the single-device model would draw."""
