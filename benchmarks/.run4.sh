python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 PYTHONUNBUFFERED=1
R=/tmp/r4; mkdir -p $R
( export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 -m pytest -m gpu tests/test_prefill.py -q -rfE -p no:cacheprovider -k hopper > $R/gpu_prefill.log 2>&1
  timeout 300 python3 benchmarks/prefill_gluon.py --ab --fa3 --rounds 5 > $R/ab.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 380 python3 -c "
import sys
from tritoninfer import prefill
prefill.HOPPER_PERSISTENT = False
from tritoninfer.cli import main
sys.exit(main(['bench', 'prefill', '--providers', 'tritoninfer,flashinfer,flex,sdpa', '--replays', '15', '--eager-reps', '10', '--plan-reps', '5', '--no-progress', '--out', '$R/sweep-np/prefill']))
" > $R/sweep.log 2>&1 ) &
wait
tar czf $OUT/r4.tgz -C /tmp r4
