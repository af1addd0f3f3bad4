#!/usr/bin/env bash
# The full default `tritoninfer bench` sweep on the H200 with FlashInfer 0.5.3, split into parts that
# each fit one 10-minute command of the device tool. Run from the repository root on the GPU machine:
#
#     bash benchmarks/h200_sweep.sh PART OUT_DIR      # PART: decode8 decode32 decode-flex prefill cascade-append
#
# Wheels: `bash /work/shared/tools/peer-wheels.sh .peers` here first, and carry `.peers` to the device.
# Then copy OUT_DIR/*/ into benchmarks/results/h200/ (the decode parts as decode-32-8.* and
# decode-32-32.*) and update benchmarks/results/h200.md. On an nvidia-h200-x2 machine two parts run
# at once, one per GPU (CUDA_VISIBLE_DEVICES=0 / 1): the whole sweep then takes about 10 minutes.
set -euo pipefail
part=${1:?part: decode8 | decode32 | decode-flex | prefill | cascade-append}
out=${2:?output folder}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16
fast="--replays 15 --eager-reps 10 --plan-reps 5 --no-progress"
case "$part" in
  decode8) python3 -m tritoninfer bench decode --heads 32/8 --kv-dtype bf16,e4m3 --providers tritoninfer,flashinfer,sdpa $fast --out "$out/decode-32-8" ;;
  decode32) python3 -m tritoninfer bench decode --heads 32/32 --kv-dtype bf16,e4m3 --providers tritoninfer,flashinfer,sdpa $fast --out "$out/decode-32-32" ;;
  # FlexAttention compiles once per decode shape (torch.compile, static shapes): its own part, with
  # tritoninfer in the same run for the ratios
  decode-flex) python3 -m tritoninfer bench decode --heads 32/8,32/32 --providers tritoninfer,flex $fast --out "$out/decode-flex" ;;
  prefill) python3 -m tritoninfer bench prefill --providers tritoninfer,flashinfer,flex,sdpa $fast --out "$out/prefill" ;;
  cascade-append)
    python3 -m tritoninfer bench cascade --providers tritoninfer,flashinfer $fast --out "$out/cascade"
    python3 -m tritoninfer bench append --providers tritoninfer,flashinfer $fast --out "$out/append" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
