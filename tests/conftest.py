"""Every parity test runs with verification on: ``ANNOT_VERIFY=1`` makes each
``annot.parallelize`` (in this process and in every rank ``run_ranks`` spawns,
which inherit the environment) check after each backward that every
tp-replicated parameter has the same gradient on every tp rank."""

import os

os.environ["ANNOT_VERIFY"] = "1"
