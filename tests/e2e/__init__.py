"""End-to-end parity: whole models through annot.parallelize on real gloo ranks,
against the single-device model, across the rewriters, the runtime and the build."""
