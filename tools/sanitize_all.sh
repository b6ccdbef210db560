#!/bin/bash
# compute-sanitizer's four tools over decode-attention launches (tools/sanitize_decode.py),
# on the GPU machine: bash tools/sanitize_all.sh SHAPE ...
# Two files under $OUT: san_summary.txt and san_logs.txt (each log's last 60 lines).
# The first, unsanitized pass compiles the variants into the cache and checks the outputs.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; logs=$(mktemp -d)
python3 tools/sanitize_decode.py "$@" > "$logs/plain.log" 2>&1; echo "plain rc=$?" | tee "$OUT/san_summary.txt"
for tool in memcheck synccheck initcheck racecheck; do
    extra=""; [ "$tool" = racecheck ] && extra="--racecheck-report all"
    timeout 240 compute-sanitizer --tool "$tool" $extra python3 tools/sanitize_decode.py "$@" > "$logs/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1)" | tee -a "$OUT/san_summary.txt"
done
for f in plain memcheck synccheck initcheck racecheck; do echo "== $f"; tail -60 "$logs/$f.log"; done \
    > "$OUT/san_logs.txt"
