#!/usr/bin/env bash
# GPU correctness on the H200 host: the CUDA-only tests, then the end-to-end restart tests with both
# services on CUDA. Run from the repo root; results under $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi -L | tee "$OUT/gpu_smoke.log"
python3 -c "import torch, transformers, fla, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'zmq', zmq.__version__)" 2>&1 | tee -a "$OUT/gpu_smoke.log"
echo "== CUDA tests ==" | tee -a "$OUT/gpu_smoke.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_target_packing.py tests/test_ring.py \
  tests/test_drafter_model.py -k "gpu or cuda or registered" 2>&1 | tail -25 | tee -a "$OUT/gpu_smoke.log"
echo "== end to end on CUDA (${DFPIPE_TEST_TARGET_DEVICES:-cuda:0} -> ${DFPIPE_TEST_TRAINER_DEVICE:-cuda:0}) ==" | tee -a "$OUT/gpu_smoke.log"
export DFPIPE_TEST_TARGET_DEVICES=${DFPIPE_TEST_TARGET_DEVICES:-cuda:0} DFPIPE_TEST_TRAINER_DEVICE=${DFPIPE_TEST_TRAINER_DEVICE:-cuda:0}
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/test_e2e_restart.py tests/test_e2e_trainer.py \
  -k "killed_repeatedly or two_ranks" 2>&1 | tail -40 | tee -a "$OUT/gpu_smoke.log"
for d in /tmp/pytest-of-*/pytest-current/*; do
  for f in "$d"/*.log; do [ -f "$f" ] && { echo "--- $f"; grep -v "falling back" "$f" | tail -30; } ; done
done > "$OUT/service_logs.txt" 2>&1
