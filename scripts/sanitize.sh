#!/usr/bin/env bash
# Builds the native core and the data plane's kernels with AddressSanitizer and UndefinedBehaviorSanitizer
# (a debug build: asserts on) and runs the test suite, or the command given,
# against it. Needs the .venv from scripts/setup.sh.
#   scripts/sanitize.sh                      # the whole suite
#   scripts/sanitize.sh -m pytest -q tests/test_core_differential.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
B=build/sanitize
"$PY" -m pip install -q nanobind >/dev/null
cmake -S . -B "$B" -G Ninja -DKVTIER_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DPython_EXECUTABLE="$PY" -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" >/dev/null
cmake --build "$B" >/dev/null
export KVTIER_CORE_LIB="$PWD/$(ls "$B"/_core*.so)"
export KVTIER_NATIVE_LIB="$PWD/$(ls "$B"/_native*.so)"
export LD_PRELOAD="$(g++ -print-file-name=libasan.so):$(g++ -print-file-name=libubsan.so)"
# CPython and torch keep memory until exit by design: leak reports would be noise
# a test asks for more memory than exists and expects a clean error, not an abort
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_init_order=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if [ $# -eq 0 ]; then
  set -- -m pytest -q -p no:cacheprovider
fi
exec "$PY" "$@"
