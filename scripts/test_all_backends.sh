#!/usr/bin/env bash
# Runs the test suite once per Keras backend: tensorflow, jax, torch.
#
# Usage: scripts/test_all_backends.sh [pytest arguments]
#   With no argument, runs `python -m pytest -q tests`; arguments replace `tests`
#   (e.g. `scripts/test_all_backends.sh tests/test_masking.py -x`).
#   BACKENDS="jax torch" picks the backends; PYTHON picks the interpreter;
#   PYTEST_WORKERS (default 2) the pytest-xdist worker processes per run: most
#   tests are small and single-threaded, and two workers on two cores run the
#   suite about 1.5 times as fast as one process (0: no workers).
#
# Every backend runs, even after a failure; prints the wall time of each and exits
# non-zero if any run failed or collected no test (pytest's exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python}"
workers="${PYTEST_WORKERS:-2}"
read -r -a backends <<< "${BACKENDS:-tensorflow jax torch}"
if [ "$#" -eq 0 ]; then
  set -- tests
fi

summary=()
failed=0
for backend in "${backends[@]}"; do
  echo "=== KERAS_BACKEND=${backend} ${python} -m pytest -q -n ${workers} $*"
  start=$SECONDS
  status=0
  KERAS_BACKEND="${backend}" "${python}" -m pytest -q -n "${workers}" "$@" || status=$?
  seconds=$((SECONDS - start))
  case "${status}" in
    0) result="passed" ;;
    5) result="FAILED: no test ran (pytest exit code 5)"; failed=1 ;;
    *) result="FAILED (pytest exit code ${status})"; failed=1 ;;
  esac
  summary+=("${backend}: ${result} in ${seconds} s")
  echo "=== ${backend}: ${result} in ${seconds} s"
done

echo "=== summary"
printf '  %s\n' "${summary[@]}"
exit "${failed}"
