#!/usr/bin/env bash
# The GPU machines' Triton, here: a side venv with triton 3.6.0 (what the device has; this checkout's venv has 3.9)
# and the offline sm_90 build of every kernel variant and tuning candidate under it (benchmarks/compile_check.py),
# then (unless --compile-only) a kernel test file under that Triton's interpreter. No GPU needed.
#
#   bash benchmarks/device_stack_check.sh [--compile-only]       VENV=/work/venv-t36 by default
#
# torch is pinned to the CPU build this checkout uses (torch==2.13.0): an unpinned `pip install torch` pulls the
# CUDA build, gigabytes. The device runs torch 2.11; only Triton decides what compiles, so 2.13 stands in for it.
# Exit status: the compile check's (1 when any variant fails), or the tests'.
set -u
set -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-/work/venv-t36}
TRITON_VERSION=3.6.0
TORCH_VERSION=2.13.0

if ! "$VENV/bin/python" -c "import triton, sys; sys.exit(triton.__version__ != '$TRITON_VERSION')" 2>/dev/null; then
  echo "making $VENV: torch==$TORCH_VERSION triton==$TRITON_VERSION"
  python3 -m venv "$VENV" || exit 1
  # cbatch's own requirements too (the tests import them); the pins keep pip off the CUDA torch and Triton 3.9
  "$VENV/bin/python" -m pip install -q -e "$ROOT" "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" pytest hypothesis || exit 1
fi
"$VENV/bin/python" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__)"

# the check imports cbatch from this checkout (benchmarks/compile_check.py puts it on sys.path); no interpreter
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$VENV/bin/python" "$ROOT/benchmarks/compile_check.py" 90 \
  > "${TMPDIR:-/tmp}/compile_check_t36.log" 2>&1
rc=$?
grep -E "^FAIL" "${TMPDIR:-/tmp}/compile_check_t36.log"
echo "compile check under triton $TRITON_VERSION: $(grep -c '^ok' "${TMPDIR:-/tmp}/compile_check_t36.log") variant(s) ok," \
  "$(grep -c '^FAIL' "${TMPDIR:-/tmp}/compile_check_t36.log") failed; $(tail -n 1 "${TMPDIR:-/tmp}/compile_check_t36.log")" \
  "(full log: ${TMPDIR:-/tmp}/compile_check_t36.log)"
[ "$rc" -eq 0 ] || exit "$rc"
[ "${1:-}" = --compile-only ] && exit 0

# the decode GEMM's kernels under this Triton's interpreter
cd "$ROOT" && TRITON_INTERPRET=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
  "$VENV/bin/python" -m pytest -p no:cacheprovider -q -x tests/test_kernels_gemm.py -k "matches or split_k"
