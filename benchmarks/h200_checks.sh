#!/usr/bin/env bash
# The GPU checks a session owes before it calls a kernel or host-path issue resolved, split into parts
# that each fit one 10-minute command of the device tool. Run from the repository root on the GPU
# machine:
#
#     bash benchmarks/h200_checks.sh PART[,PART...] OUT_DIR
#
# Several comma-separated parts run at the same time (GPU tests and FlashInfer's tests share the GPU
# well; never put a speed part beside another part), each within LIMIT seconds (default 570), and
# everything they wrote is packed into OUT_DIR/checks.tgz (the device tool returns at most 8 files).
# PART:
#   tests-core   pytest -m gpu on the attention files (launch, decode, prefill, cascade, safety, route)
#   tests-new-a  pytest -m gpu, two workers, on the wave-2 attention files (MLA, POD, BatchAttention,
#                block-sparse, fp8 queries, multi-item)
#   tests-new-b  ... on sampling, the logits processor, transformers and the demo
#   tests-tf     pytest -m gpu on the transformers integration and demo --hf files (one process)
#   tests-rest   pytest -m gpu on everything else (compile, rope, norm, page, engines, ...)
#   ab-merge     device time of the working tree against OLD=<dir holding an older tritoninfer> (decode,
#                the fused split merge); needs OLD set, e.g. OLD=.ab/pre24 (carry it); a watchdog prints
#                the stacks if it hangs
#   host         benchmarks/host_path.py, every decode and prefill row, FlashInfer in the same process
#   host-ab      ... the quick rows, with OLD=<dir holding an older tritoninfer> beside (e.g. OLD=.ab/pre18)
#   tests-launch pytest -m gpu on the launch path: driver launches, bound launches rebound by a new plan, re-plans,
#                CUDA-graph capture, replayed runs (test_launch.py, test_replay.py, and decode/prefill's launch
#                and graph tests)
#   fit          FlashInfer's own tests for sampling and the logits processor (FIT_PER_TEST=20, 4 workers:
#                the sampling tests synchronise after every call, and many processes time-slice the GPU);
#                FIT_K="softmax or min_p" passes -k to pytest (any fit part); FIT_WORKERS=1 overrides a part's workers
#   tests-sampling  pytest -m gpu on the sampling, logits-processor and demo-sampling tests
#   fit-lp       FlashInfer's own tests for the logits processor alone (2 workers)
#   fit-lp-vs    ... the logits processor's pipeline-against-function cases only (exact sample equality)
#   fit-multi-item  ... test_hopper.py's multi-item scoring cases only
#   fit-hopper   ... for test_hopper.py and test_batch_prefill_kernels.py (4 workers)
#   sampling-profile  benchmarks/sampling_profile.py: kernel breakdown of each sampling function, with
#                and without the compaction before the rejection sampler, FlashInfer beside
#   sampling-host  ... --host: each function's eager host time with the driver launch path on and off,
#                its launches, its heaviest Python functions (FlashInfer's host time beside)
#   ncu-sampling Nsight Compute on the renorm and sampling kernels (benchmarks/ncu_sampling.py, NCU_BATCH
#                rows, default 256): throughput, occupancy, warp stalls, memory; needs the Firecracker runtime
#   ncu-decode   Nsight Compute on the Gluon fp8 decode and the core's fp8 decode (benchmarks/ncu_decode.py)
#   ncu-prefill  Nsight Compute on the Gluon prefill, ragged causal, head_dim 128, 256 and 192 / 128 (prefill_once.py;
#                NCU_SET=MODULE.NAME=VALUE: one --set for the runs, e.g. _hopper.HEAD_SECTIONS=true)
#   ncu-rows     Nsight Compute on the grid's rows below 0.95x that no ncu has seen (session 25): decode 16/2 1 x 4096
#                bf16 and 32/32 d256 1 x 32K page 64 e4m3 (planner's tiles, decode_once.py), page-1 prefill 4 x 4096
#                causal on the core (prefill_once.py)
#   ncu-mla      Nsight Compute on the MLA decode kernels (benchmarks/ncu_mla.py; NCU_MLA_SHAPES as bench mla
#                --shapes, default 128 and 16 heads 64 x 8K at page 64): stalls, occupancy, memory
#   fit-sink-mla FlashInfer's own tests for attention sinks and DeepSeek MLA (2 workers)
#   fit-pod-ba   FlashInfer's own tests for POD and BatchAttention (2 workers)
#   tests-new-a1 tests-new-a in one process (beside FlashInfer's tests)
#   fit-new-a    FlashInfer's own tests for MLA, POD, BatchAttention, sinks (FIT_PER_TEST=20)
#   fit-new-b    ... for block-sparse, Hopper fp8, rope, norm, batch prefill (multi-item), Hopper; the fit
#                parts need ../shared/flashinfer-tests copied to .fit (carry it)
#   groups-a     tritoninfer bench sampling and mla, --quick (speed against FlashInfer, same process)
#   groups-b     tritoninfer bench pod, sparse and rope-append, --quick
#   transformers benchmarks/bench_transformers.py (generate, generate_batch against sdpa; #26's numbers)
#   tests-s15    pytest -m gpu on session 15's unrun changes: single_prefill captured in a CUDA graph, the
#                block-sparse route, compile at two batch sizes (test_prefill -k captured, test_sparse,
#                test_compile, test_route)
#   fit-s15      FlashInfer's test_block_sparse.py (2 workers), then under FIT_COMPILE=1 (3 cases a test)
#                the sampling and multi-item cases that failed at e9e8462
#   tests-s16    pytest -m gpu on session 16's changes: POD's prefill half on the Gluon kernel (test_pod, test_route)
#   tests-mla    pytest -m gpu tests/test_mla.py (all of it, on the default route)
#   fit-decode   FlashInfer's decode tests (batch decode, tensor-core decode, non-contiguous, fp8 scales; 4 workers)
#   fit-mla      FlashInfer's test_deepseek_mla.py and test_mla_page.py (4 workers)
#   fit-bp-rest  test_batch_prefill_kernels.py's ragged and multi-item cases (fit-hopper's limit cut them, s17)
#   tests-gluon  pytest -m gpu on both Gluon kernels (prefill incl. gathered pages, MLA incl. gather), -x
#   tests-mla-modes  pytest -m gpu tests/test_mla.py's Gluon-route tests (every mode, CUDA graphs, no KV)
#   mla-sets     tritoninfer bench mla over the issue's rows, once per --set of MLA_SETS (FlashInfer beside the first)
#   tests-mla-gluon  pytest -m gpu on the Gluon MLA kernel (tests/test_mla.py -k gluon; _route.MLA_HOPPER forced on)
#   mla-ab       tritoninfer bench mla --quick with the Gluon MLA kernel on, then off (FlashInfer beside: run
#                warm-mla first)
#   mla-prefill  DeepSeek's non-absorbed prefill (ragged, 192 / 128): pytest -m gpu on its Gluon-route test, then
#                tritoninfer bench mla --prefill with _route.HOPPER_192_128 (and HOPPER_FORCE) on, FlashInfer beside,
#                then ours on the core
#   rope-tune    benchmarks/rope_append_tune.py: the fused RoPE-quantize-append's program shapes, ours alone
#   pod-ab       tritoninfer bench pod --quick, ours only, with POD's prefill half on the Gluon kernel and without
#                (_route.POD_PREFILL_ON_HOPPER)
#   fit-23a/b    FlashInfer's own tests for every file issue 23 names, in two halves (FIT_PER_TEST default 12
#                here, 4 workers each): a = POD, BatchAttention, sinks, block-sparse, Hopper fp8; b = rope,
#                norm, batch prefill, Hopper
#   warm-fi      FlashInfer's sampling module JIT-compiled, to run beside test parts before bench-sampling
#   warm-grid    benchmarks/grid_warm.py: the grid's FlashInfer JIT modules and our variants, one process per
#                provider and KV dtype (MAX_JOBS=3 each), beside test parts; then bench-all with BENCH_ARGS="--grid
#                --grid-part K/N" times kernels (session 23: cold, part 2 of 2 ran out of its 330 s in the JIT)
#   warm-GROUP   tritoninfer bench GROUP --quick beside the test parts, numbers discarded: FlashInfer's
#                JIT variants compiled before the timed bench-GROUP (POD's took over 90 s)
#   bench-GROUP  tritoninfer bench GROUP $BENCH_ARGS (default --quick), e.g. bench-sampling
#
# Wheels: `bash ../shared/tools/peer-wheels.sh .peers` here first, and carry `.peers`; for the
# transformers tests also a transformers 5.24 wheel in .tfw (the GPU image has 5.17; its other
# dependencies are there). Each part logs per-file durations (pytest --durations) so the next session
# knows what a part costs. Run GPU test files with at most two workers: eight ran out of GPU memory.
#
# Measured in session 10 (what a part costs, and what went wrong): the device tool returns at most 8
# files, so write OUT_DIR outside $OUT and copy only the archives there (`... /tmp/w1; tar czf
# $OUT/all.tgz -C /tmp w1`). FlashInfer's tests beside the GPU test parts ran the GPU out of memory
# (its 5M-draw sampling tests held 15-90 GB each before the per-source passes; transformers sizes its
# paged cache from free memory and failed): run fit-* parts beside each other, and tests-* parts
# beside fit-* only at one worker. In 330 s at 4 workers, `fit` finished 112 sampling cases (all
# passed; the 5M-draw cases were the slow ones); `fit-pod-ba` takes ~2 min; `fit-new-b` did not reach
# test_hopper.py in 270 s; `tests-new-a1` ran 35 tests in 270 s. bench-sampling --quick ~150 s after
# warm-fi; bench rope-append and sparse < 90 s each; bench pod > 90 s (FlashInfer's POD JIT: warm-pod).
#
# Measured in session 11: tests-sampling 127-197 s; fit + fit-sink-mla + tests-sampling + warm-fi + warm-pod
# in parallel fit 320 s (fit reached neither TestLogitsPipeVsSamplingOps nor the 5M-draw cases: run
# fit-lp-vs on its own); warm-pod did not finish FlashInfer's POD JIT in 250 s (bench-pod then timed out at
# 75 s: time ours with BENCH_ARGS="--quick --providers tritoninfer-pod,tritoninfer-separate"); bench-sampling
# --quick ~95 s after warm-fi; bench-mla --quick < 120 s after warm-mla; sampling-profile (64, 256 rows,
# no FlashInfer) ~60 s. A fresh machine costs ~60-90 s of device time before the command starts.
#
# Measured in session 13: tests-tf + tests-core + tests-sampling + warm-fi at LIMIT=300 then transformers
# (LIMIT=200) fit one 430 s command (tests-tf reached 10 of 15 tests; the other 5 took 169 s alone);
# fit + warm-mla 200 s, bench-sampling --quick < 140 s, bench-mla --quick < 90 s after warm-mla. Speed
# parts log what else ran on the machine when they started (busy-PART.txt).
#
# Measured in session 14: fit (every sampling and logits-processor case at FIT_PER_TEST=20: 1,512) beside
# tests-sampling and warm-fi finished within 370 s; bench-sampling --quick then < 150 s; the issue's sweep at
# 32K and 262K vocabularies (11 functions x 4 batches, --replays 10 --calls-per-graph 3) 313 s.
#
# Measured in session 15: the fit part's 1,512 are log lines: FIT_LOG holds each case twice (756 cases); count
# cases with NAME-counts.txt. tests-sampling + fit + warm-fi 218 s; the issue's sweep at two vocabularies
# ~115 s after warm-fi (113 s for 32K + 128K); FIT_COMPILE=1 over 10 files at 3 cases a test did not finish
# in 230 s (142 cases); tritoninfer demo (gpu preset) ~10 s once its kernels are compiled; host_path.py
# --quick ~11 s after a warm run; bench pod / sparse --quick, ours only, ~20 s each. A fresh machine cannot
# be had with less than ~350 s of device time left.
#
# Measured in session 12: tests-core + tests-new-a1 + tests-new-b + tests-rest in parallel: only tests-rest
# finished in 300 s (60 passed, 168 s); at 230 s tests-core reached 42 tests, tests-new-a1 37, tests-new-b 16
# (tests-new-b's transformers files alone: 8 tests in 170 s). fit-lp-vs finished (225 passed) within 240 s; bench-sampling
# --quick ~100 s and bench-mla --quick < 60 s after the warm-ups; `transformers` (generate_batch with its
# whole-workload warm-up, tritoninfer and sdpa) ~130 s, prefill + generate ~60 s.
set -euo pipefail
parts=${1:?part: tests-core | tests-new-a | tests-new-b | tests-rest | ab-merge | host | fit | fit-new-a | fit-new-b | groups-a | groups-b}
out=$(realpath -m "${2:?output folder}")
limit=${LIMIT:-570}
mkdir -p "$out"
[ -d /tmp/site/flashinfer ] ||
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl $(ls .tfw/*.whl 2>/dev/null) 2>/dev/null
if [[ $parts == *,* ]]; then
  for p in ${parts//,/ }; do LIMIT=$limit NO_PACK=1 bash "$0" "$p" "$out" > "$out/part-$p.out" 2>&1 & done
  wait
  tar czf "$out/checks.tgz" -C "$out" --exclude checks.tgz .
  exit 0
fi
part=$parts
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16
case "$part" in
  transformers|bench-*|host|sampling-*|ab-merge)
    # a speed part: what else holds the GPU or the CPU when it starts (session 13's transformers run
    # followed test parts cut by their limit, and both implementations came out 11-50 % slower)
    { echo "# before $part, $(date -u +%T)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
      ps -eo pid,ppid,pcpu,etime,args --sort=-pcpu 2>/dev/null | head -12; } > "$out/busy-$part.txt" 2>&1 || true ;;
esac
core="tests/test_launch.py tests/test_decode.py tests/test_prefill.py tests/test_cascade.py tests/test_safety.py tests/test_route.py"
new_a="tests/test_mla.py tests/test_pod.py tests/test_batch_attention.py tests/test_sparse.py tests/test_fp8_query.py
  tests/test_multi_item.py"
new_b="tests/test_sampling.py tests/test_logits_processor.py tests/test_integration_transformers.py tests/test_demo.py"
# FlashInfer's tests at FIT_PER_TEST=20 from .fit; per-test outcome counts in NAME-counts.txt
fit_run() {
  local name=$1 workers=${FIT_WORKERS:-$2}; shift 2
  (cd .fit && PYTHONPATH=/tmp/site:$OLDPWD FIT_PER_TEST=${FIT_PER_TEST:-20} FIT_LOG="$out/$name.tsv" timeout "$limit" python3 -m pytest \
    -n "$workers" -q -p no:cacheprovider --timeout 150 ${FIT_K:+-k "$FIT_K"} $* > "$out/$name.log" 2>&1 || true)
  sort -u -t$'\t' -k3,3 "$out/$name.tsv" | awk -F'\t' '{split($3,a,"::"); split(a[2],b,"["); print $1, a[1]"::"b[1]}' \
    | sort | uniq -c > "$out/$name-counts.txt" || true
}
case "$part" in
  tests-core)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 $core \
      > "$out/tests-core.log" 2>&1 || true ;;
  tests-new-a|tests-new-b)
    files=$new_a; [ "$part" = tests-new-b ] && files=$new_b
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider --durations=15 $files \
      > "$out/$part.log" 2>&1 || true ;;
  tests-rest)
    ignore=$(for f in $core $new_a $new_b; do printf -- "--ignore=%s " "$f"; done)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests/ $ignore \
      > "$out/tests-rest.log" 2>&1 || true ;;
  ab-merge)
    PYTHONPATH=$PWD timeout "$limit" python3 benchmarks/ab_versions.py --old "pre=${OLD:?OLD=dir of the older tritoninfer}" \
      --shapes few --rounds 5 --tolerance 0.03 --watchdog 560 --out "$out/ab-merge.md" > "$out/ab-merge.log" 2>&1 || true ;;
  host-ab)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/host_path.py --quick \
      --old "pre=${OLD:?OLD=dir of the older tritoninfer}" --out "$out/host-ab.md" > "$out/host-ab.log" 2>&1 || true ;;
  tests-launch)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      tests/test_launch.py tests/test_decode.py tests/test_prefill.py tests/test_replay.py \
      -k "driver or bound or rebind or graph or launch or replay or replans" > "$out/$part.log" 2>&1 || true ;;
  host)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/host_path.py --profile --out "$out/host-path.md" \
      > "$out/host-path.log" 2>&1 || true ;;
  tests-tf)
    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider \
      --durations=20 tests/test_integration_transformers.py tests/test_demo_hf.py > "$out/$part.log" 2>&1 || true ;;
  tests-sampling)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
      tests/test_sampling.py tests/test_logits_processor.py tests/test_demo.py -k "sampling or logits" \
      > "$out/$part.log" 2>&1 || true ;;
  fit)
    fit_run fit 4 tests/utils/test_sampling.py tests/utils/test_logits_processor.py ;;
  tests-s15)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      tests/test_prefill.py -k "captured or sparse or compile or route" tests/test_sparse.py tests/test_compile.py \
      tests/test_route.py > "$out/$part.log" 2>&1 || true ;;
  fit-s15)
    fit_run fit-sparse 2 tests/utils/test_block_sparse.py
    FIT_COMPILE=1 FIT_PER_TEST=3 FIT_K="test_top_p_sampling or test_sampling_from_logits or variable_k or multi_item" \
      fit_run fit-compile 2 tests/utils/test_sampling.py tests/attention/test_batch_prefill_kernels.py ;;
  tests-s16)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      tests/test_pod.py tests/test_route.py > "$out/$part.log" 2>&1 || true ;;
  tests-mla)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
      tests/test_mla.py > "$out/$part.log" 2>&1 || true ;;
  tests-gluon)
    # the Gluon kernels after a change to their signatures: prefill (ragged, paged, gathered pages), MLA, fp8 decode
    # one pytest call a file, within one limit: a file's failures (--maxfail) do not keep the next one from
    # running (session 19: the MLA gather's 8 compile failures stopped the run before test_decode.py)
    deadline=$((SECONDS + limit))
    for f in tests/test_decode.py tests/test_prefill.py tests/test_mla.py; do
      left=$((deadline - SECONDS)); [ "$left" -gt 10 ] || break
      PYTHONPATH=/tmp/site:$PWD timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 \
        --maxfail=8 --timeout 90 "$f" -k "hopper or gluon or graph or without_kv or gather" \
        >> "$out/$part.log" 2>&1 || true
    done ;;
  tests-mla-modes)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 -x \
      --timeout 90 tests/test_mla.py -k "${MLA_K:-gluon or graph or without_kv}" > "$out/$part.log" 2>&1 || true ;;
  mla-sets)
    # the issue's rows (and batch 128, 16 x 32K at 16 heads), once per --set of MLA_SETS (space-separated;
    # "-" for none; several settings of one run joined by +), FlashInfer beside the first (run warm-mla first)
    shapes=128:64:1:8192:1,128:64:16:8192:1,128:64:64:8192:1,128:64:128:8192:1,128:64:16:32768:1,128:64:64:4096:4
    shapes=$shapes,128:1:64:4096:1,16:64:64:8192:1,16:64:128:8192:1,16:64:16:32768:1,16:64:64:4096:4,16:1:64:4096:1
    first=1
    for set in ${MLA_SETS:--}; do
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / 2)) python3 -m tritoninfer bench mla --shapes $shapes \
        $([ $first = 1 ] || echo --backends=) $([ "$set" = - ] || printf -- '--set %s ' ${set//+/ }) --out "$out/mla-$set" \
        > "$out/mla-$set.log" 2>&1 || true
      first=0
    done ;;
  tests-mla-gluon)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 -x \
      tests/test_mla.py -k gluon > "$out/$part.log" 2>&1 || true ;;
  mla-ab)
    for on in true false; do
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / 2)) python3 -m tritoninfer bench mla --quick \
        --set _route.MLA_HOPPER=$on --out "$out/mla-ab-$on" > "$out/mla-ab-$on.log" 2>&1 || true
    done ;;
  mla-prefill)
    PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_prefill.py -k 192_128 > "$out/mla-prefill-tests.log" 2>&1 || true
    shapes="--shapes 128:64:1:8192:1 --prefill --prefill-shapes 128:1:4096,16:1:8192,16:8:2048"
    PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) python3 -m tritoninfer bench mla $shapes \
      --set _route.HOPPER_192_128=true --set _route.HOPPER_FORCE=true --out "$out/mla-prefill-gluon" \
      > "$out/mla-prefill-gluon.log" 2>&1 || true
    PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) python3 -m tritoninfer bench mla $shapes --backends= \
      --out "$out/mla-prefill-core" > "$out/mla-prefill-core.log" 2>&1 || true ;;
  rope-tune)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/rope_append_tune.py --out "$out/rope-tune.md" \
      > "$out/rope-tune.log" 2>&1 || true ;;
  pod-ab)
    for on in true false; do
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / 2)) python3 -m tritoninfer bench pod --quick \
        --providers tritoninfer-pod,tritoninfer-separate --set _route.POD_PREFILL_ON_HOPPER=$on \
        --out "$out/pod-ab-$on" > "$out/pod-ab-$on.log" 2>&1 || true
    done ;;
  fit-23a)
    FIT_PER_TEST=${FIT_PER_TEST:-12} fit_run fit-23a 4 tests/utils/test_pod_kernels.py \
      tests/attention/test_batch_attention.py tests/attention/test_attention_sink.py tests/utils/test_block_sparse.py \
      tests/attention/test_hopper_fp8_attention.py ;;
  fit-23b)
    FIT_PER_TEST=${FIT_PER_TEST:-12} fit_run fit-23b 4 tests/attention/test_rope.py tests/utils/test_norm.py \
      tests/attention/test_batch_prefill_kernels.py tests/attention/test_hopper.py ;;
  fit-lp)
    fit_run fit-lp 2 tests/utils/test_logits_processor.py ;;
  fit-lp-vs)
    fit_run fit-lp-vs 4 tests/utils/test_logits_processor.py -k VsSamplingOps ;;
  fit-multi-item)
    fit_run fit-multi-item 4 tests/attention/test_hopper.py -k multi_item ;;
  fit-decode)
    fit_run fit-decode 4 tests/attention/test_batch_decode_kernels.py tests/attention/test_tensor_cores_decode.py \
      tests/attention/test_non_contiguous_decode.py tests/attention/test_decode_fp8_calibration_scale.py ;;
  fit-mla)
    fit_run fit-mla 4 tests/attention/test_deepseek_mla.py tests/attention/test_mla_page.py ;;
  fit-bp-rest)
    FIT_K="ragged or multi_item_scoring" fit_run fit-bp-rest 4 tests/attention/test_batch_prefill_kernels.py ;;
  fit-hopper)
    fit_run fit-hopper 4 tests/attention/test_hopper.py tests/attention/test_batch_prefill_kernels.py ;;
  sampling-profile)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/sampling_profile.py --knob _REJECTION_ONLY_ROWS=1000000 \
      ${PROFILE_ARGS:-} \
      > "$out/sampling-profile.log" 2>&1 || true ;;
  sampling-host)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/sampling_profile.py --host ${PROFILE_ARGS:-} \
      > "$out/sampling-host.log" 2>&1 || true ;;
  ncu-sampling)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$ncu_bin" --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/ncu_sampling.py "${NCU_BATCH:-256}" \
      > "$out/ncu-sampling.txt" 2>&1 || true ;;
  ncu-decode)
    # where the Gluon fp8 decode's warps wait, beside the core's fp8 decode (32/8 heads, NCU_DECODE="BATCH KV_LEN",
    # default 64 x 4096, page 16): stall reasons by source line, occupancy, memory
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$ncu_bin" --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
      python3 benchmarks/ncu_decode.py ${NCU_DECODE:-} > "$out/ncu-decode.txt" 2>&1 || true ;;
  ncu-prefill)
    # where the Gluon prefill's warps wait at head_dim 128 (the reference: ~0.95-1.1x fa3), 256 and 192 / 128 (0.60-0.65x
    # fa3, session 24): ragged, causal, one launch each after two warm-up calls
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for dims in "128 128 32/8/4/4096" "256 256 32/8/4/4096" "192 128 128/128/1/4096"; do
      read -r dq dv shape <<< "$dims"
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) "$ncu_bin" --clock-control none -k regex:prefill_hopper_kernel \
        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
        python3 benchmarks/prefill_once.py --kv ragged --causal --head-dim "$dq" --head-dim-vo "$dv" --shape "$shape" \
        ${NCU_SET:+--set "$NCU_SET"} > "$out/ncu-prefill-$dq-$dv${NCU_SET:+-${NCU_SET//[^A-Za-z0-9]/_}}.txt" 2>&1 || true
    done ;;
  ncu-rows)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    sections="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats"
    for row in "bf16 16/2/1/4096" "float8_e4m3fn 32/32/1/32768/256/64"; do
      read -r dtype shape <<< "$row"
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) "$ncu_bin" --clock-control none -k regex:attention \
        --launch-skip 2 --launch-count 1 $sections python3 benchmarks/decode_once.py --kv-dtype "${dtype/bf16/bfloat16}" \
        --shape "$shape" > "$out/ncu-decode-${shape//\//-}.txt" 2>&1 || true
    done
    PYTHONPATH=/tmp/site:$PWD timeout $((limit / 3)) "$ncu_bin" --clock-control none -k regex:attention \
      --launch-skip 2 --launch-count 1 $sections python3 benchmarks/prefill_once.py --kv paged --page-size 1 --causal \
      --shape 32/8/4/4096 > "$out/ncu-prefill-page1.txt" 2>&1 || true ;;
  ncu-mla)
    # where the Gluon MLA kernel's warps wait (NCU_MLA_SHAPES as bench mla --shapes; default 128 and 16 heads,
    # page 64, 64 x 8K): stall reasons, occupancy, memory
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$ncu_bin" --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters python3 benchmarks/ncu_mla.py ${NCU_MLA_SHAPES:-} \
      > "$out/ncu-mla.txt" 2>&1 || true ;;
  fit-sink-mla)
    fit_run fit-sink-mla 2 tests/attention/test_attention_sink.py tests/attention/test_deepseek_mla.py ;;
  fit-pod-ba)
    fit_run fit-pod-ba 2 tests/utils/test_pod_kernels.py tests/attention/test_batch_attention.py ;;
  tests-new-a1)
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 $new_a \
      > "$out/$part.log" 2>&1 || true ;;
  fit-new-a)
    fit_run fit-new-a 4 tests/attention/test_deepseek_mla.py tests/attention/test_mla_page.py \
      tests/utils/test_pod_kernels.py tests/attention/test_batch_attention.py tests/attention/test_attention_sink.py ;;
  fit-new-b)
    fit_run fit-new-b 4 tests/utils/test_block_sparse.py tests/attention/test_hopper_fp8_attention.py \
      tests/attention/test_rope.py tests/utils/test_norm.py tests/attention/test_batch_prefill_kernels.py \
      tests/attention/test_hopper.py ;;
  groups-a|groups-b)
    # FlashInfer JIT-compiles its sampling module and two MLA backends on a fresh machine: two groups
    # per command, each within its own timeout
    if [ "$part" = groups-a ]; then set -- sampling mla; else set -- pod sparse rope-append; fi
    for g in "$@"; do
      PYTHONPATH=/tmp/site:$PWD timeout $((limit / $#)) python3 -m tritoninfer bench $g --quick --out "$out" \
        > "$out/bench-$g.log" 2>&1 || true
    done ;;
  transformers)
    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 timeout "$limit" python3 benchmarks/bench_transformers.py \
      --impls "${TF_IMPLS:-tritoninfer,sdpa}" --out "$out/transformers.md" \
      > "$out/transformers.log" 2>&1 || true ;;
  warm-fi)
    # FlashInfer JIT-compiles its sampling module on first use (a minute on a fresh machine): done here,
    # beside the test parts, so that a bench-sampling after them times kernels, not the compiler
    PYTHONPATH=/tmp/site timeout "$limit" python3 -c "
import torch, flashinfer.sampling as s
p = torch.rand(4, 32000, device='cuda').softmax(-1)
s.top_k_top_p_sampling_from_probs(p, 50, 0.9); s.top_p_sampling_from_probs(p, 0.9)
s.top_k_renorm_probs(p, 50); s.sampling_from_probs(p); torch.cuda.synchronize(); print('warm')" \
      > "$out/warm-fi.log" 2>&1 || true ;;
  warm-grid)
    # one process per provider and KV dtype, and per head_dim for FlashInfer's prefill paths (a module each, ~100 s)
    for p in flashinfer-fa3 flashinfer-fa2 flashinfer-tc flashinfer-cc tritoninfer; do for k in bf16 e4m3; do
      dims="0"; case $p in flashinfer-fa*) dims="64 128 256" ;; esac
      for d in $dims; do
        hd=""; [ "$d" = 0 ] || hd="--head-dim $d"
        (MAX_JOBS=2 PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 benchmarks/grid_warm.py --provider $p --kv-dtype $k \
          $hd > "$out/warm-grid-$p-$k-$d.log" 2>&1 || true) &
      done
    done; done
    wait ;;
  warm-*)
    # a bench group run beside the test parts, its numbers thrown away: FlashInfer's JIT cache
    # (FLASHINFER_WORKSPACE_BASE) and Triton's then hold its variants for the timed bench-GROUP after
    g=${part#warm-}
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m tritoninfer bench "$g" --quick --out "/tmp/warm-$g" \
      > "$out/warm-$g.log" 2>&1 || true ;;
  bench-*)
    g=${part#bench-}
    PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m tritoninfer bench "$g" ${BENCH_ARGS:---quick} --out "$out" \
      > "$out/bench-$g.log" 2>&1 || true ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
tail -3 "$out"/*.log 2>/dev/null || true
[ -n "${NO_PACK:-}" ] || tar czf "$out/checks.tgz" -C "$out" --exclude checks.tgz .
