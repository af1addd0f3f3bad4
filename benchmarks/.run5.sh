export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r5; mkdir -p $R
( export CUDA_VISIBLE_DEVICES=0
  timeout 140 ncu --clock-control none -k regex:ragged_prefill_hopper --launch-skip 2 --launch-count 1 \
     --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
     python3 benchmarks/prefill_once.py --kv ragged --shape 32/8/4/4096 > $R/ncu_src_4k.csv 2> $R/ncu_src_4k.err ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 140 ncu --clock-control none -k regex:ragged_prefill_hopper --launch-skip 2 --launch-count 1 \
     --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
     --section ComputeWorkloadAnalysis \
     python3 benchmarks/prefill_once.py --kv paged --shape 32/8/16/1024 --causal > $R/ncu_16k_causal.log 2>&1 ) &
wait
tar czf $OUT/r5.tgz -C /tmp r5
