#!/bin/bash
# One GPU-machine run: the GPU tests and/or benchmarks, logs and results under $OUT.
#
#   bash benchmarks/gpu_run.sh tests            # every GPU test (pytest -m gpu)
#   bash benchmarks/gpu_run.sh attention        # decode table vs XQA + FA4, 3 runs (+ extra rows)
#   bash benchmarks/gpu_run.sh gpt-oss          # head_dim-64 gpt-oss table, 3 runs
#   bash benchmarks/gpu_run.sh shapes           # sibling shapes (GQA 4/16, d64, pages 32/64), 3 runs
#   bash benchmarks/gpu_run.sh models1          # real models' shapes, group 1 (21 rows), 3 runs; models2 likewise
#   bash benchmarks/gpu_run.sh fp8              # fp8 KV-cache decode table vs XQA-fp8 and bf16, 3 runs
#   FP8_ROWS='64/8 d64 B=64 L=8k' bash benchmarks/gpu_run.sh fp8-rows   # those rows of it (--rows), FP8_RUNS runs (3)
#   bash benchmarks/gpu_run.sh qkv              # QKV step and GEMV benchmark
#   bash benchmarks/gpu_run.sh qkv-fp8          # QKV step writing an e4m3 cache vs the bf16 one
#   bash benchmarks/gpu_run.sh stream-tests     # the streaming QKV GEMV's GPU tests
#   bash benchmarks/gpu_run.sh stream-sanitize  # compute-sanitizer's four tools over both MMA kinds of the stream
#   bash benchmarks/gpu_run.sh stream           # the op's QKV GEMV per M (M 1..64) against the mma.sync ring (s6)
#   bash benchmarks/gpu_run.sh stream-ab        # the op's QKV step per M against the same with weights prefetched
#                                               # into L2 before the grid wait (L: whole ranges, L8 8 units ahead),
#                                               # the TMA ring (T, TL), at 8 tokens (s8gt), 2 CTAs per SM
#                                               # (s4c2gt[l8]; s4c2gtf16l8: heads finished in 16-token slices)
#   bash benchmarks/gpu_run.sh ab-tests         # the GPU tests of those launch options (L2 prefetch, TMA)
#   bash benchmarks/gpu_run.sh stream-shapes    # hidden 1024..8192 BF16 (qkv_shapes' models): the op's design per
#                                               # token tile against the wgmma ring of 8 stages at M = 1, 8, 64
#   bash benchmarks/gpu_run.sh ab-sanitize      # compute-sanitizer's four tools over three of them
#   bash benchmarks/gpu_run.sh tile8-tests      # the 8-token tile's streaming rule (hidden >= 3584): test_qkv's
#                                               # numerics of those specs, graph replay per token tile
#   bash benchmarks/gpu_run.sh qkv-fp8-tests    # every fp8 QKV GPU test (both designs)
#   bash benchmarks/gpu_run.sh tile8-sanitize   # compute-sanitizer's four tools over an 8-token ring (bf16, fp8)
#                                               # and the cluster design's fp8 write
#   bash benchmarks/gpu_run.sh window-clusters  # the short-window cluster band's GPU tests (bf16, fp8), then
#                                               # compute-sanitizer's four tools over its first shape
#   bash benchmarks/gpu_run.sh sweep            # decode config sweep (best of 3)
#   bash benchmarks/gpu_run.sh sweep-passes     # the same, 8 interleaved passes, XQA-fp8 beside the fp8 rows
#   bash benchmarks/gpu_run.sh sweep-fp8-row    # 16 interleaved passes with XQA-fp8 (written for sweep run 22,
#                                               # the fp8 64/8 B=128 row), clocks / power / temperatures sampled
#                                               # ($OUT/smi.csv), then that row of the fp8 table (FP8_RUNS runs)
#   bash benchmarks/gpu_run.sh sweep-b1         # sweep run 24: 16/2 B = 1 at 1k-32k with 4-warp CTAs (132 splits),
#                                               # 5 interleaved passes (the sweep modes time ROWS as it is now)
#   bash benchmarks/gpu_run.sh sweep-kv-evict   # sweep run 23 (ROWS at 652e321): K/V evict-first on the goal rows, 5
#                                               # interleaved passes, caches rotated beyond L2; then the option's
#                                               # GPU tests and compute-sanitizer's four tools over the first
#   bash benchmarks/gpu_run.sh qkv-fp8-ablation # what the QKV step's fp8 write costs, variant by variant, 5 runs
#   bash benchmarks/gpu_run.sh decode-step      # examples/decode_step.py at B = 8 and 64 (issue 18 item 6)
#   bash benchmarks/gpu_run.sh qkv-timeline     # per-CTA stamps of the RMSNorm + QKV step and the GEMV alone
#                                               # (benchmarks/qkv_timeline.py; prebuild with its --prebuild;
#                                               # TIMELINE_ROWS=REGEX: those rows alone, as --rows)
#   bash benchmarks/gpu_run.sh cluster-tests    # the streaming GEMV's cluster finish (reduce-scatter through DSMEM)
#   bash benchmarks/gpu_run.sh cluster-ab       # the op per M (16..64) against the cluster finish (s8gk2d, s6gk2d;
#                                               # CLUSTER_AB_CONFIGS=labels: others), 3 runs
#   bash benchmarks/gpu_run.sh cluster-sanitize # compute-sanitizer's four tools over 2- and 4-rank cluster finishes
#   bash benchmarks/gpu_run.sh l2-rule          # the 16-64-token grouped L2 rule's GPU tests: test_qkv's token tiles
#                                               # of flint-bf16 / hidden 4096 (tiles 16 / 32 / 64 of both settings),
#                                               # graph replay per tile; compute-sanitizer's four tools over three
#                                               # (L2_RULE_SANITIZE: other -k ids; prebuild: tools/prebuild_gpu_tests.py
#                                               # qkv:flint_t64,flint_bf16_t64,bf16_4096_t64)
#
# Expects the DSL (or its runtime) and peers on PYTHONPATH (source .device*/setup.sh
# first) and FLINTGEN_CACHE_DIR pointing at a carried cache; FLINTGEN_COMMIT names
# the commit in result headers (the GPU machine's copy has no git metadata).
# Benchmarks write their <name>.md/.json into $OUT (harness.write_results), which
# the device tool brings back: do not copy benchmarks/results/ into $OUT after
# them (that overwrites the new tables with the committed ones).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; \
  echo "commit ${FLINTGEN_COMMIT:-unknown}"; } > "$OUT/run_info.txt"
rc=0
sanitize_stream() {  # NAME K: compute-sanitizer's four tools over the streaming QKV tests -k K, logs $OUT/NAME_<tool>.log
    local tool extra st
    for tool in memcheck racecheck synccheck initcheck; do
        extra=(); [ "$tool" = memcheck ] && extra=(--report-api-errors no)
        [ "$tool" = racecheck ] && extra=(--racecheck-report all)
        compute-sanitizer --tool "$tool" "${extra[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider \
            tests/test_qkv_stream.py -k "$2" > "$OUT/$1_$tool.log" 2>&1
        st=$?; rc=$((rc || st))
        echo "$tool rc $st: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/$1_$tool.log" | tail -1)"
    done
}
for what in "$@"; do
    case "$what" in
        tests) python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider -rfEx tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
               rc=$((rc || PIPESTATUS[0])) ;;
        attention) python3 -m benchmarks.decode_attention --runs 3 2>&1 | tee "$OUT/decode_attention.log" | tail -30 ;;
        gpt-oss) python3 -m benchmarks.decode_attention --gpt-oss --runs 3 2>&1 | tee "$OUT/gpt_oss.log" | tail -5 ;;
        shapes) python3 -m benchmarks.decode_attention --shapes --runs 3 2>&1 | tee "$OUT/shapes.log" | tail -30 ;;
        models1|models2) python3 -m benchmarks.decode_attention --models --group "${what#models}" --runs 3 2>&1 \
               | tee "$OUT/$what.log" | tail -30 ;;
        fp8) python3 -m benchmarks.decode_attention --fp8 --runs 3 2>&1 | tee "$OUT/fp8.log" | tail -30 ;;
        fp8-rows) python3 -m benchmarks.decode_attention --fp8 --runs "${FP8_RUNS:-3}" --rows "${FP8_ROWS:?set FP8_ROWS}" 2>&1 \
               | tee "$OUT/fp8_rows.log" | tail -12 ;;
        qkv) python3 -m benchmarks.qkv 2>&1 | tee "$OUT/qkv.log" | tail -30 ;;
        qkv-fp8) python3 -m benchmarks.qkv --fp8 2>&1 | tee "$OUT/qkv_fp8.log" | tail -12 ;;
        stream-tests) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_qkv_stream.py 2>&1 \
               | tee "$OUT/stream_tests.log" | tail -25; rc=$((rc || PIPESTATUS[0])) ;;
        stream-sanitize) sanitize_stream stream_sanitize "(wgmma_numerics and (oss_bf16-M9 or flint_bf16-M40)) or (test_stream_numerics and (flint_bf16-M33 or glm4-M2))" ;;
        stream) python3 -m benchmarks.qkv --stream --ms 1,2,4,8,16,32,64 --no-fill --configs s6 2>&1 \
               | tee "$OUT/qkv_stream.log" | tail -60 ;;
        stream-ab) python3 -m benchmarks.qkv --stream --ms 1,2,4,8,16,32,64 --no-fill --configs L,L8,T,TL,s8gt,s4c2gt,s4c2gtl8,s4c2gtf16l8 \
               2>&1 | tee "$OUT/qkv_stream_ab.log" | tail -60 ;;
        ab-tests) S=tests/test_qkv_stream.py
               { python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx $S tests/test_qkv.py \
                      -k "(other_configs and (gt or l)) or (other_launch_configs and l2)"; r1=$?
                 python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx \
                      "$S::test_stream_graph_replay_with_changed_inputs[tma]" \
                      "$S::test_stream_layers_back_to_back_race_free[tma]"; exit $((r1 || $?)); } 2>&1 \
                   | tee "$OUT/ab_tests.log" | tail -15
               rc=$((rc || PIPESTATUS[0])) ;;
        stream-shapes) python3 -m benchmarks.qkv --stream --shapes --ms 1,8,64 --no-fill --configs s8g \
               2>&1 | tee "$OUT/qkv_stream_shapes.log" | tail -30 ;;
        ab-sanitize) sanitize_stream ab_sanitize "other_configs and (s8w1gt-M1 or s6w1gtf32l8-M64 or s8w1gl8-M1)" ;;
        tile8-tests) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_qkv.py tests/test_qkv_tokens.py \
                   -k "(test_numerics and not other_launch and (bf16_4096 or glm4 or h16384_bf16)) or graph_replay_per_token_tile" \
                   2>&1 | tee "$OUT/tile8_tests.log" | tail -8
               rc=$((rc || PIPESTATUS[0])) ;;
        qkv-fp8-tests) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_qkv_fp8.py \
                   tests/test_qkv_stream.py -k "fp8" 2>&1 | tee "$OUT/qkv_fp8_tests.log" | tail -8
               rc=$((rc || PIPESTATUS[0])) ;;
        tile8-sanitize) bash tools/sanitize.sh tile8 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_qkv.py \
                   -k "test_numerics and (bf16_4096-M8 or glm4-M5)"
               bash tools/sanitize.sh qkv_fp8 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_qkv_fp8.py \
                   -k "bytes_bit_exact and (flint-M3 or glm4-M5)" ;;
        window-clusters) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_decode_attention_grid.py \
                   tests/test_decode_attention_fp8.py -k "cluster_sizes or two_ctas" 2>&1 | tee "$OUT/window_clusters.log" | tail -5
               rc=$((rc || PIPESTATUS[0]))
               bash tools/sanitize.sh window_clusters "${WC_LIMIT:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider \
                   tests/test_decode_attention_grid.py tests/test_decode_attention_fp8.py -k "cluster_sizes and 0" ;;
        l2-rule) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_qkv.py tests/test_qkv_tokens.py \
                   -k "(test_numerics_token_tiles and (flint_bf16_t64 or bf16_4096_t64)) or graph_replay_per_token_tile" \
                   2>&1 | tee "$OUT/l2_rule_tests.log" | tail -8
               rc=$((rc || PIPESTATUS[0]))
               bash tools/sanitize.sh l2_rule "${L2_RULE_LIMIT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider \
                   tests/test_qkv.py -k "test_numerics_token_tiles and (${L2_RULE_SANITIZE:-flint_bf16_t64-M17 or bf16_4096_t64-M16 or bf16_4096_t64-M33})" ;;
        sweep) python3 -m benchmarks.decode_attention_sweep 2>&1 | tee "$OUT/sweep.md" ;;
        sweep-passes) python3 -m benchmarks.decode_attention_sweep --passes 8 --xqa 2>&1 | tee "$OUT/sweep.md" | tail -30 ;;
        sweep-b1) python3 -m benchmarks.decode_attention_sweep --passes 5 2>&1 | tee "$OUT/sweep.md" | tail -24 ;;
        sweep-kv-evict) python3 -m benchmarks.decode_attention_sweep --passes 5 --rotate 2>&1 | tee "$OUT/sweep.md" | tail -12
               bash tools/sanitize.sh kv_evict "${KV_EVICT_LIMIT:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider \
                   tests/test_decode_attention_shapes.py -k kv_evict_first_gpu ;;
        sweep-fp8-row) q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory
               nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
               smi=$!; sleep 1
               kill -0 $smi 2>/dev/null || { nvidia-smi --query-gpu=$q --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 & smi=$!; }
               python3 -m benchmarks.decode_attention_sweep --passes 16 --xqa 2>&1 | tee "$OUT/sweep.md" | tail -8
               python3 -m benchmarks.decode_attention --fp8 --runs "${FP8_RUNS:-7}" --rows '64/8 d128 B=128 L=8k' 2>&1 \
                   | tee "$OUT/fp8_rows.log" | tail -6
               kill $smi ;;
        qkv-fp8-ablation) python3 -m benchmarks.qkv_fp8_ablation --runs 5 2>&1 | tee "$OUT/qkv_fp8_ablation.log" | tail -50 ;;
        qkv-timeline) python3 -m benchmarks.qkv_timeline ${TIMELINE_ROWS:+--rows "$TIMELINE_ROWS"} 2>&1 \
               | tee "$OUT/qkv_timeline.log" | tail -40 ;;
        cluster-tests) python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider -rfEx tests/test_qkv_stream.py \
               -k "cluster or k2d or k4d" 2>&1 | tee "$OUT/cluster_tests.log" | tail -25; rc=$((rc || PIPESTATUS[0])) ;;
        cluster-ab) for i in 1 2 3; do   # three runs, each its own table under $OUT/run<i>
                   OUT="$OUT/run$i" python3 -m benchmarks.qkv --stream --ms 16,32,64 --no-fill \
                       --configs "${CLUSTER_AB_CONFIGS:-s8gk2d,s6gk2d}" --results qkv_stream_cluster; done 2>&1 \
               | tee "$OUT/cluster_ab.log" | tail -40 ;;
        cluster-sanitize) sanitize_stream cluster_sanitize \
               "(cluster_numerics and (flint_bf16-M64 or qwen_896-M31)) or (other_configs and s6w1gk4d-M9)" ;;
        decode-step) for b in 8 64; do python3 examples/decode_step.py --batch "$b"; done 2>&1 \
               | tee "$OUT/decode_step.log" | tail -12 ;;
        *) echo "unknown: $what" >&2; exit 2 ;;
    esac
done
exit $rc
