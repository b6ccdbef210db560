#!/bin/bash
# compute-sanitizer's four tools over GPU tests, on the GPU machine:
#   bash tools/sanitize_pytest.sh NAME PYTEST_ARGS...
# Two files under $OUT: NAME_summary.txt and NAME_logs.txt (tools/sanitize.sh).
name="$1"; shift
exec bash "$(dirname "$0")/sanitize.sh" "$name" 300 python3 -m pytest -m gpu -q -p no:cacheprovider "$@"
