#!/usr/bin/env bash
# Runs Python tests against the bindings built with AddressSanitizer.
#
#   sanitizers/asan-python.sh [pytest arguments]     (default: the whole tests/ folder)
#
# The extension (a cdylib) is built with -Zsanitizer=address (stable rustc, RUSTC_BOOTSTRAP=1) into
# target/asan, copied with the Python package into a temporary folder, and the tests import it
# from there. Python itself is not instrumented, so the ASan runtime is preloaded: GCC's libasan
# (same ABI as rustc's LLVM one: both export __asan_version_mismatch_check_v8), with libstdc++
# preloaded too so that ASan's __cxa_throw interceptor finds the real one (torch throws C++
# exceptions). Leak detection is off: the interpreter and torch keep memory until exit.
#
# A report is written to target/asan/report.<pid> (pytest captures stderr, and a process that ASan
# stops would take its report with it); the script lists them and fails if there is any.
# PYTHON picks the interpreter (default: python3 on PATH); extra ASAN_OPTIONS are appended.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TRIPLE=x86_64-unknown-linux-gnu

RUSTC_BOOTSTRAP=1 RUSTFLAGS=-Zsanitizer=address CARGO_TARGET_DIR=target/asan \
    cargo build -p ramtorch-py --release --target "$TRIPLE"

pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
cp -r python/ramtorch "$pkg/"
find "$pkg" -name '_core*.so' -delete
cp "target/asan/$TRIPLE/release/lib_core.so" "$pkg/ramtorch/_core.abi3.so"

libasan=$(readlink -f "$(gcc -print-file-name=libasan.so)")
libstdcxx=$(readlink -f "$(gcc -print-file-name=libstdc++.so)")
export LD_PRELOAD="$libasan $libstdcxx"
rm -f target/asan/report.*
export ASAN_OPTIONS="detect_leaks=0:log_path=$PWD/target/asan/report${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export PYTHONPATH="$pkg"

"$PYTHON" -c 'import ramtorch._core as c, sys; print("testing", c.__file__, file=sys.stderr)'
rc=0
"$PYTHON" -m pytest -p no:cacheprovider "${@:-tests}" || rc=$?
if compgen -G 'target/asan/report.*' >/dev/null; then
    echo "AddressSanitizer reports:" >&2
    cat target/asan/report.* >&2
    exit 1
fi
exit "$rc"
