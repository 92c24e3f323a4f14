"""libcst source transforms: tensor-parallel, pipeline staging, diagnostics. Never imports runtime."""
