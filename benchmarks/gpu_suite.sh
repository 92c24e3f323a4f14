#!/usr/bin/env bash
# What runs on a lent GPU machine, in one call (results go in benchmarks/GPU.md).
# There: the image's python3 with its torch and transformers, no network; libcst,
# typeguard and pytest-timeout come as wheels in .whl/ (carried from here), and
# annot/runtime, annot/rewriters are linked to the top-level folders as the
# install maps them. Everything lands under $OUT.
#
#   bash benchmarks/gpu_suite.sh            # on the device, from the repository root
#   TESTS="tests/test_fsdp.py" CHECK_S=1 bash benchmarks/gpu_suite.sh   # those tests only
#   PIPE_S=240 bash benchmarks/gpu_suite.sh   # also the pipeline benchmarks on its CPU cores
set -u
OUT=${OUT:-/tmp/annot-gpu}
mkdir -p "$OUT"
SITE=/tmp/annot-site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl >"$OUT/pip.txt" 2>&1
ln -sfn ../runtime annot/runtime
ln -sfn ../rewriters annot/rewriters
export PYTHONPATH="$SITE:$PWD"
export OMP_NUM_THREADS=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, transformers, libcst, hypothesis; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "hypothesis", hypothesis.__version__)'
} >"$OUT/versions.txt" 2>&1

# The fast suite with CUDA visible (or TESTS="file::test ..." only those): names of
# what fails, and a per-test limit so one test that hangs cannot hide the others'.
if [ -n "${TESTS:-}" ]; then set -- $TESTS; else set -- -m "not slow"; fi
timeout "${SUITE_S:-300}" python3 -m pytest "$@" -n 15 -v --timeout 90 \
    -p no:cacheprovider --junitxml "$OUT/fast.xml" >"$OUT/fast.txt" 2>&1
echo "suite rc=$?" >>"$OUT/fast.txt"

timeout 60 python3 -m pytest -q -p no:cacheprovider -k cuda \
    tests/runtime/test_recompute.py tests/runtime/init/test_deferred.py >"$OUT/cuda_tests.txt" 2>&1

timeout "${CHECK_S:-150}" torchrun --nproc-per-node 1 benchmarks/gpu_check.py --steps 10 \
    >"$OUT/gpu_check.txt" 2>&1
echo "gpu_check rc=$?" >>"$OUT/gpu_check.txt"

# The pipeline step against torch.distributed.pipelining on the machine's CPU cores
# (gloo, one torch thread a rank: a core for each rank and its network thread, which
# this 2-core machine cannot give), and the rendezvous latency that 2 cores show.
if [ -n "${PIPE_S:-}" ]; then
    {
        nproc
        timeout 30 python3 benchmarks/p2p_rendezvous.py
        BENCH_RUNS=3 BENCH_STEPS=15 timeout "$PIPE_S" python3 benchmarks/pp.py --a
        BENCH_SPLITS=uniform BENCH_STEPS=7 timeout 120 python3 benchmarks/pp_llama.py
    } >"$OUT/pipe.txt" 2>&1
fi

cat "$OUT/versions.txt"
grep -E "^(FAILED|ERROR)|Timeout|passed|failed" "$OUT/fast.txt" | tail -60
tail -3 "$OUT/cuda_tests.txt"
tail -30 "$OUT/gpu_check.txt"
[ -f "$OUT/pipe.txt" ] && grep -vE "^\s*$|Warning|warn" "$OUT/pipe.txt" | tail -40
