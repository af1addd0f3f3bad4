#!/usr/bin/env bash
# The GPU checks a session owes before it calls a kernel or host-path issue resolved, split into parts
# that each fit one 10-minute command of the device tool. Run from the repository root on the GPU
# machine:
#
#     bash benchmarks/h200_checks.sh PART OUT_DIR
#
# PART:
#   tests-core   pytest -m gpu on the attention files (launch, decode, prefill, cascade, safety, route)
#   tests-rest   pytest -m gpu on everything else (compile, rope, norm, page, sampling, engines, demo, ...)
#   ab-merge     device time of the working tree against OLD=<dir holding an older tritoninfer> (decode,
#                the fused split merge; prefill); needs OLD set, e.g. OLD=.ab/pre24 (carry it)
#   host         benchmarks/host_path.py, every decode and prefill row, FlashInfer in the same process
#   fit          FlashInfer's own tests for sampling, logits processor, rope, norm (FIT_PER_TEST=20);
#                needs ../shared/flashinfer-tests copied to .fit (carry it)
#
# Wheels: `bash ../shared/tools/peer-wheels.sh .peers` here first, and carry `.peers`. Each part logs
# per-file durations (pytest --durations) so the next session knows what a part costs.
set -euo pipefail
part=${1:?part: tests-core | tests-rest | ab-merge | host | fit}
out=${2:?output folder}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16
core="tests/test_launch.py tests/test_decode.py tests/test_prefill.py tests/test_cascade.py tests/test_safety.py tests/test_route.py"
case "$part" in
  tests-core)
    PYTHONPATH=/tmp/site:$PWD timeout 580 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 $core \
      > "$out/tests-core.log" 2>&1 || true ;;
  tests-rest)
    ignore=$(for f in $core; do printf -- "--ignore=%s " "$f"; done)
    PYTHONPATH=/tmp/site:$PWD timeout 580 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests/ $ignore \
      > "$out/tests-rest.log" 2>&1 || true ;;
  ab-merge)
    PYTHONPATH=$PWD timeout 580 python3 benchmarks/ab_versions.py --old "pre=${OLD:?OLD=dir of the older tritoninfer}" \
      --shapes few --rounds 5 --tolerance 0.03 --out "$out/ab-merge.md" > "$out/ab-merge.log" 2>&1 || true ;;
  host)
    PYTHONPATH=/tmp/site:$PWD timeout 580 python3 benchmarks/host_path.py --profile --out "$out/host-path.md" \
      > "$out/host-path.log" 2>&1 || true ;;
  fit)
    (cd .fit && PYTHONPATH=/tmp/site:$OLDPWD FIT_PER_TEST=20 FIT_LOG="$out/fit.tsv" timeout 580 python3 -m pytest -n 8 -q \
      --timeout 150 tests/utils/test_sampling.py tests/utils/test_logits_processor.py tests/utils/test_norm.py \
      tests/attention/test_rope.py > "$out/fit.log" 2>&1 || true)
    sort -u -t$'\t' -k3,3 "$out/fit.tsv" | cut -f1 | sort | uniq -c > "$out/fit-counts.txt" || true ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
tail -5 "$out"/*.log 2>/dev/null || true
