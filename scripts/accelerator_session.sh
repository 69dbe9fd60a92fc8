#!/usr/bin/env bash
# One accelerator session's figures and checks from one command, each part under its own cap:
#   1. `python -m lconv.bench gpu --minutes BENCH_MINUTES`: the op table, the LM train step, the default run and beam
#      decoding (docs/benchmarks-gpu.md and docs/bench/gpu/, packed into OUT/bench.tgz as it ends);
#   2. the quick tier of the suite on the accelerator (JAX_PLATFORMS=cuda) for TEST_SECONDS, the files that touch
#      devices, kernels and numerics first; one line per test in OUT/tests.log, and each failure's traceback in
#      OUT/failures.log as it happens (tests/failures_now.py), so a cut run still says what passed and why not.
# The bench runs alone first: tests sharing the GPU would make its timings wrong.
#
#   [TOTAL_SECONDS=N] scripts/accelerator_session.sh BENCH_MINUTES TEST_SECONDS OUT [extra bench flags, e.g. --profile]
# OUT is made owner-only if it is not there, and must be a folder no other user can change, nor the way to it: the
# session's files are written into it by name. The script runs from the clone it is in, with Python's -P and this
# clone alone on PYTHONPATH, wherever it is started: another user's jax/ or tests/ in the working folder is never
# imported or collected.
# On CPU, `TEST_PLATFORMS=cpu scripts/accelerator_session.sh 2 60 ~/session --quick` smoke-tests the script.
set -uo pipefail
bench_minutes=$1 test_seconds=$2 out=$3
shift 3
case $out in /*) ;; *) out="$PWD/$out" ;; esac
root=$(cd -- "$(dirname -- "$0")/.." && pwd -P) && cd -- "$root" || exit 2
export PYTHONPATH=$root
python -P -c 'import sys
from lconv import shared_folders
from lconv.errors import UserError
try:
    shared_folders.raise_problem(shared_folders.make_checked(sys.argv[1]), "OUT")
except UserError as err:
    sys.exit(f"error: {err}")' "$out" || exit 2
export PYTHONUNBUFFERED=1
{ nvidia-smi -L 2>/dev/null; python -P -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$out/machine.txt"

# The bench stops its own stages at their caps (a stage's overrun comes out of the next one's); the outer timeout is
# only a backstop.
timeout "$(python -P -c "print(int($bench_minutes * 60 + 100))")" python -P -m lconv.bench gpu --minutes "$bench_minutes" "$@" \
  2>&1 | tee "$out/bench.log"
# --quick writes to this user's own scratch folder (lconv.bench's QUICK_DIR), never a fixed name in /tmp
case " $* " in
  *" --quick "*) results=$(python -P -c "from lconv.bench.__main__ import QUICK_DIR; print(QUICK_DIR)") ;;
  *) results="docs/benchmarks-gpu.md docs/bench/gpu" ;;
esac
tar czf "$out/bench.tgz" $results 2>/dev/null || echo "no bench results to pack" | tee -a "$out/bench.log"

first=(test_decode test_sharding test_stream test_pallas_conv test_ops test_mixers test_linear_cross_entropy
       test_fairseq_parity test_golden_loss test_precision test_attention test_attention_kernels test_models
       test_api test_api_decoding test_api_features test_api_load test_train test_layers test_memory test_colt5)
files=("${first[@]/#/tests/}"); files=("${files[@]/%/.py}")
for f in tests/test_*.py; do
  case " ${files[*]} " in *" $f "*) ;; *) [ "$f" = tests/test_notebooks.py ] || files+=("$f") ;; esac
done
# TOTAL_SECONDS, when set, is the whole script's limit: the tests get what the bench left of it, up to TEST_SECONDS.
[ -n "${TOTAL_SECONDS:-}" ] && test_seconds=$(( TOTAL_SECONDS - SECONDS - 15 < test_seconds ? TOTAL_SECONDS - SECONDS - 15 : test_seconds ))
workers=$(( $(nproc) > 4 ? $(nproc) - 4 : 2 ))
JAX_PLATFORMS=${TEST_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false LCONV_FAILURES_LOG="$out/failures.log" \
  PYTHONPATH="$root:$root/tests" timeout "$test_seconds" \
  python -P -m pytest -v -p no:cacheprovider -p failures_now -n "$workers" -m "not slow" "${files[@]}" > "$out/tests.log" 2>&1
echo "tests: exit $? (124: cut at ${test_seconds} s)" | tee -a "$out/tests.log"
grep -c " PASSED " "$out/tests.log" | sed 's/^/passed: /'
grep -E " (FAILED|ERROR) " "$out/tests.log" | head -40
