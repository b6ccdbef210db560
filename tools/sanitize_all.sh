#!/bin/bash
# compute-sanitizer's four tools over decode-attention launches (tools/sanitize_decode.py),
# on the GPU machine: bash tools/sanitize_all.sh SHAPE ...
# Two files under $OUT: san_summary.txt and san_logs.txt (tools/sanitize.sh).
exec bash "$(dirname "$0")/sanitize.sh" san 240 python3 tools/sanitize_decode.py "$@"
