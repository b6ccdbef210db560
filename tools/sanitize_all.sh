#!/bin/bash
# compute-sanitizer's four tools over decode-attention launches (tools/sanitize_decode.py),
# on the GPU machine: bash tools/sanitize_all.sh SHAPE ...   (logs and a summary under $OUT)
# The first, unsanitized pass compiles the variants into the cache and checks the outputs.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 tools/sanitize_decode.py "$@" > "$OUT/san_plain.log" 2>&1; echo "plain rc=$?" | tee "$OUT/san_summary.txt"
for tool in memcheck synccheck initcheck racecheck; do
    extra=""; [ "$tool" = racecheck ] && extra="--racecheck-report all"
    timeout 240 compute-sanitizer --tool "$tool" $extra python3 tools/sanitize_decode.py "$@" > "$OUT/san_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san_$tool.log" | tail -1)" | tee -a "$OUT/san_summary.txt"
done
