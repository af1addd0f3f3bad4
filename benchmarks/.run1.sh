python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 PYTHONUNBUFFERED=1
R=/tmp/r1; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/smi.txt
( export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 -m pytest -m gpu tests/test_prefill.py -q -rfE -p no:cacheprovider > $R/gpu_prefill.log 2>&1
  timeout 260 python3 -m pytest -m gpu tests -q -rfE -p no:cacheprovider --ignore tests/test_prefill.py > $R/gpu_rest.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 benchmarks/prefill_gluon.py --paged --fa3 > $R/paged.log 2>&1
  timeout 200 ncu --clock-control none -k regex:ragged_prefill_hopper --launch-skip 2 --launch-count 1 \
     --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
     --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats \
     python3 benchmarks/prefill_once.py --kv ragged --shape 32/8/4/4096 > $R/ncu_gluon.log 2>&1 ) &
wait
tar czf $OUT/r1.tgz -C /tmp r1
