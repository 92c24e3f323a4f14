"""Every parity test runs with verification on: ``ANNOT_VERIFY=1`` makes each
``annot.parallelize`` (in this process and in every rank ``run_ranks`` spawns,
which inherit the environment) check after each backward that every
tp-replicated parameter has the same gradient on every tp rank."""

import os
import shutil
import tempfile

os.environ["ANNOT_VERIFY"] = "1"

# The cache of rewritten modules: one throwaway folder for the session (every
# rank spawned inherits it), never the user's ~/.cache/annot. A test that
# checks the cache itself points ANNOT_CACHE_DIR at its own tmp_path.
CACHE_DIR = tempfile.mkdtemp(prefix="annot-tests-cache-")
os.environ["ANNOT_CACHE_DIR"] = CACHE_DIR


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
