python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 PYTHONUNBUFFERED=1
R=/tmp/r3; mkdir -p $R
( export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 -m pytest -m gpu tests/test_prefill.py -q -rfE -p no:cacheprovider > $R/gpu_prefill.log 2>&1
  timeout 330 python3 benchmarks/prefill_gluon.py --paged --fa3 > $R/paged.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 benchmarks/prefill_gluon.py --fa3 > $R/ragged.log 2>&1
  timeout 340 bash benchmarks/h200_sweep.sh prefill $R/sweep > $R/sweep.log 2>&1 ) &
wait
tar czf $OUT/r3.tgz -C /tmp r3
