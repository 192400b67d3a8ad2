#!/usr/bin/env bash
# dfpipe's GPU benchmark suite: every part in its own python process with its own timeout, all
# figures in $OUT/results.json, one log per part. Run from anywhere inside the repository:
#
#     bash bench/gpu/run_all.sh                 # the headline figures, under 10 minutes on one H200
#     bash bench/gpu/run_all.sh --quick         # tiny sizes: the CPU smoke run
#     bash bench/gpu/run_all.sh --token-budget 8192 --p6-seconds 15   # any gpu_bench.py flag, to every part
#
# With no flags it measures the headline figures in one run on one fresh GPU: P5d (the drafter
# step in the trainer's default precision, bf16), P2, P4 (warm restart against a cold start with an
# empty Triton cache, scaled to the full depth's load) and P6d (a 60 s window, its baselines from
# this run's p5d and p23), and P7 from those rates. --p5d-other-precision fp8 adds P5f (FP8
# against bf16 on the same batches, and their gradients' cosine) to p5d.
# Other parts (tests copycheck p1 p5 scale placements fp8lib fp8 long) run when BENCH_PARTS names
# them: BENCH_PARTS="env fp8" the FP8 target (P8), "env long" whole 32K-token documents (P2L, P5dL). Environment: OUT (default ./out), BENCH_BUDGET_S (wall budget of the whole run,
# default 570), BENCH_LIMIT_PERCENT (every part's upper limit, in percent; default 100), PYTHON
# (default python3), DFPIPE_BENCH_WORKDIR (fixtures, Triton cache, service runs; default
# /tmp/dfpipe-gpu-bench). $OUT receives results.json and one .log per part. The
# table of results is printed last: anything not measured says so.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ARGS=("$@")
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
export DFPIPE_BENCH_WORKDIR=${DFPIPE_BENCH_WORKDIR:-/tmp/dfpipe-gpu-bench}
export DFPIPE_BENCH_RUN_ID=${DFPIPE_BENCH_RUN_ID:-$$}
mkdir -p "$DFPIPE_BENCH_WORKDIR"
PY=${PYTHON:-python3}
BUDGET_S=${BENCH_BUDGET_S:-570}
START=$(date +%s)
rm -f "$OUT/results.json" "$OUT"/*.log

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }

# Service processes a part left behind (it was killed before its own cleanup): by pid, and only
# if that pid still runs dfpipe. Then the ring files of this run (named dfpgb-<run id>-*), if any
# remain: another run on the same host keeps its own.
cleanup_children() {
  local pidfile="$DFPIPE_BENCH_WORKDIR/service-pids.txt" pid name
  if [[ -f $pidfile ]]; then
    while read -r pid name; do
      if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q dfpipe; then
        log "killing leftover $name (pid $pid)"
        kill -9 "$pid" 2>/dev/null
      fi
    done <"$pidfile"
    rm -f "$pidfile"
  fi
  rm -f "/dev/shm/dfpgb-$DFPIPE_BENCH_RUN_ID-"* 2>/dev/null
  return 0
}
trap cleanup_children EXIT

# ---- environment: wheels, versions, the GPU ------------------------------------------------------
{
  if compgen -G ".whl/*.whl" >/dev/null; then
    log "installing .whl/*.whl into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
      || log "wheel install FAILED (parts needing them will say so)"
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}   # keeps a caller's (FA4 installed apart)
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
} >"$OUT/env.log" 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Autotune once per run: later processes read FLA's tuned configs from the Triton cache.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$DFPIPE_BENCH_WORKDIR/triton}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
cleanup_children

# ---- parts ----------------------------------------------------------------------------------------
# name, upper limit (s), least time it needs (s): a slow part may not eat the later parts' minimum.
read -ra PARTS <<< "${BENCH_PARTS:-env p5d p23 services p7}"  # BENCH_PARTS: the parts to run, in order
declare -A LIMIT=([env]=150 [tests]=${TESTS_LIMIT:-400} [copycheck]=180 [p1]=90 [p5]=${P5_LIMIT:-180} [p5d]=${P5D_LIMIT:-240} [p7]=30 [p23]=${P23_LIMIT:-150}
                  [services]=330 [scale]=${SCALE_LIMIT:-300} [placements]=${PLACEMENTS_LIMIT:-300} [fp8lib]=120
                  [long]=${LONG_LIMIT:-240} [fp8]=150)
# BENCH_LIMIT_PERCENT scales every LIMIT (the CPU smoke run on a slower or busier machine: tests/machine_speed.py)
LIMIT_PERCENT=${BENCH_LIMIT_PERCENT:-100}
declare -A NEED=([env]=30 [tests]=40 [copycheck]=40 [p1]=15 [p5]=30 [p5d]=120 [p7]=5 [p23]=60 [services]=200 [scale]=60
                 [placements]=100 [fp8lib]=40 [long]=60 [fp8]=60)

run_part() {
  local name=$1 i later=0 left t rc t0 limit
  for (( i = ${#PARTS[@]} - 1; i >= 0; i-- )); do
    [[ ${PARTS[i]} == "$name" ]] && break
    later=$(( later + NEED[${PARTS[i]}] ))
  done
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  t=$(( left - later ))
  limit=$(( LIMIT[$name] * LIMIT_PERCENT / 100 ))
  (( t > limit )) && t=$limit
  (( t < NEED[$name] && left >= NEED[$name] )) && t=${NEED[$name]}
  # a part starts with at least its own need, or 15 s for one needing more (P7's projection takes ~5)
  if (( t < (NEED[$name] < 15 ? NEED[$name] : 15) )); then
    log "part $name: not run (the run's ${BUDGET_S}s budget is spent)"
    $PY -m bench.gpu.results mark "$name" --rc -1 --reason "not run: the run's ${BUDGET_S}s budget was spent"
    return
  fi
  log "part $name: up to ${t}s -> $OUT/$name.log"
  t0=$(date +%s)
  timeout -k 15 "$t" $PY bench/gpu/gpu_bench.py "$name" --part-budget $(( t > 30 ? t - 15 : t )) "${ARGS[@]}" \
    >>"$OUT/$name.log" 2>&1
  rc=$?
  $PY -m bench.gpu.results mark "$name" --rc "$rc" --seconds $(( $(date +%s) - t0 ))
  log "part $name: rc $rc after $(( $(date +%s) - t0 ))s ($(tail -n 1 "$OUT/$name.log" | cut -c1-160))"
  cleanup_children
}

log "dfpipe GPU benchmarks: OUT=$OUT, workdir $DFPIPE_BENCH_WORKDIR, budget ${BUDGET_S}s, args: ${ARGS[*]:-(none)}"
for name in "${PARTS[@]}"; do
  run_part "$name"
done

log "done in $(( $(date +%s) - START ))s; files in $OUT:"
ls -la "$OUT"
$PY -m bench.gpu.results summary
