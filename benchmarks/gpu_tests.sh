#!/usr/bin/env bash
# GPU test run as one device call: installs the wheels carried in .whl/ (hypothesis,
# transformers and their dependencies; fetch them with `make gpu-wheels`) when the machine
# lacks them, then runs pytest on CUDA over the given test files (all tests, not only those
# marked gpu: on a GPU every test runs on CUDA), log to $OUT/tests.log, a summary last.
# Usage on the device: bash benchmarks/gpu_tests.sh tests/test_x.py ...  (TESTS_TIMEOUT=s)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl hypothesis transformers 2>&1 | tail -n 2
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
# SIGINT at the limit (then KILL 30 s later): pytest stops as on Ctrl-C and still prints its
# summary, so the failures found so far are named even when the run is cut.
timeout -s INT -k 30 "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -rfE \
  "$@" > "$OUT/tests.log" 2>&1
status=$?
tail -n 25 "$OUT/tests.log"
echo "pytest exit $status"
exit "$status"
