export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/r6; mkdir -p $R
( export CUDA_VISIBLE_DEVICES=0
  timeout 95 python3 -c "
import sys, pytest
from tritoninfer import prefill
prefill.HOPPER_PINGPONG = True
sys.exit(pytest.main(['-m', 'gpu', 'tests/test_prefill.py', '-q', '-rfE', '-p', 'no:cacheprovider', '-k', 'hopper_ragged or hopper_paged_prefill']))
" > $R/gpu_pingpong.log 2>&1
  timeout 95 python3 -m pytest -m gpu tests/test_prefill.py -q -rfE -p no:cacheprovider -k "hopper_ragged or hopper_paged_prefill" > $R/gpu_default.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/prefill_gluon.py --ab --variants persistent,ping-pong --shapes 16x1024,4x4096 --rounds 5 > $R/ab.log 2>&1 ) &
wait
tar czf $OUT/r6.tgz -C /tmp r6
