#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md ("On a GPU"), in steps that fit one lease call
# each: bash tools/gpu-session.sh STEP... (setup first). Logs go to $OUT (or ./gpu-out).
# Python packages missing on the GPU machine travel as wheels in .whl (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FULLGRAPH_DATA=/tmp/fullgraph-data PYTHONPATH=/tmp/site:$PWD
# pytest-xdist (in the H200 image) runs test files in TEST_PROCS processes at once: the
# distributed tests start 1-4 ranks each, so 4 of them fill 16 cores. The timing tests
# of tests/parallel (test_partial, test_adjust) stay on the CPU and are load-sensitive:
# read a failure of theirs against a run alone (TEST_PROCS=0 turns xdist off).
xdist_args() {
  if [ "${TEST_PROCS:-4}" != 0 ] && python3 -c 'import xdist' 2>/dev/null; then
    echo "-n ${TEST_PROCS:-4}"
  fi
}
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || exit 1
      fi
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c 'import torch, numba, triton, torch_geometric as g, pymetis
print("torch", torch.__version__, "numba", numba.__version__, "triton", triton.__version__,
      "pyg", g.__version__, "cpus", __import__("os").cpu_count())' ;;
    smoke)  # the CLI on the GPU: single process, chunked tensor, 2 workers on one GPU
      IFS=';' read -ra runs <<< "${SMOKE_RUNS:---strategy single;--strategy tensor --device-memory 2MB;--strategy data --workers 2;--strategy tensor --workers 2;--strategy p2p --workers 3}"
      for args in "${runs[@]}"; do
        for dev in ${SMOKE_DEVICES:-cpu cuda}; do
          timeout 90 python3 -m fullgraph.cli train --dataset cora --epochs 5 --device $dev $args --quiet \
            --metrics-out "$OUT/smoke.jsonl" > "$OUT/smoke-last.log" 2>&1 \
            || { echo "FAILED: $dev $args"; grep -v Warning "$OUT/smoke-last.log" | tail -20;
                 cat "$OUT/smoke-last.log" >> "$OUT/smoke-failures.log"; }
          python3 - "$OUT/smoke.jsonl" "$dev $args" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
loss = [r.get("loss") for r in rows if r.get("event", "epoch") == "epoch" and "loss" in r]
print(f"{sys.argv[2]:<45} losses {[round(x, 6) for x in loss[-5:]]}")
PY
          rm -f "$OUT/smoke.jsonl"
        done
      done ;;
    kernels)
      timeout 300 python3 -m fullgraph.bench.gpu --out "$OUT" --steps env,kernels,attention ;;
    attention)
      timeout 200 python3 -m fullgraph.bench.gpu --out "$OUT" --steps attention ;;
    beyond)
      timeout 300 python3 -m fullgraph.bench.gpu --out "$OUT" --steps beyond ;;
    models)  # TRITON=0: torch ops where the Triton kernels run (FULLGRAPH_TRITON), to compare
      for size in ${MODEL_SIZES:-1000000:20000000 4000000:80000000}; do
        set -- ${size/:/ }
        FULLGRAPH_TRITON=${TRITON:-auto} timeout ${MODEL_TIMEOUT:-200} python3 -m fullgraph.bench.models \
          --device cuda --vertices $1 --edges $2 --threads 16 --rounds 2 --epochs 3 \
          --models ${MODELS:-gcn,gat} --roofline --cache /tmp/fullgraph-bench \
          2>&1 | grep -v Warning | tee -a "$OUT/models.log"
      done ;;
    profile)  # where one epoch of each system goes on the device (torch.profiler)
      set -- ${PROFILE_SIZE:-2000000:40000000}; set -- ${1/:/ }
      timeout 300 python3 -m fullgraph.bench.models --device cuda --vertices $1 --edges $2 \
        --threads 16 --rounds 1 --epochs 2 --models ${MODELS:-gcn,gat} --profile 20 \
        --cache /tmp/fullgraph-bench 2>&1 | grep -v Warning > "$OUT/profile.log"
      grep -E "^\||epoch after|Self CUDA time total" "$OUT/profile.log" ;;
    p2p)
      for pf in "" "--no-prefetch"; do
        timeout 200 python3 -m fullgraph.bench.p2p --device cuda --workers 2 --vertices 200000 \
          --edges 8000000 --partitioners g3 --schedules ${P2P_SCHEDULES:-multi-level,sequential} --epochs 5 $pf \
          2>&1 | grep -v '^{' | tee -a "$OUT/p2p.log"
      done ;;
    tests-ops)
      FULLGRAPH_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
        --tb=short $(xdist_args) tests/ops tests/models > "$OUT/tests-ops.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-ops.log" | tail -40 ;;
    tests-parallel)
      FULLGRAPH_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-400} python3 -m pytest \
        -p no:cacheprovider -v --tb=short $(xdist_args) ${TESTS_PARALLEL:-tests/parallel} \
        > "$OUT/tests-parallel.log" 2>&1
      grep -cE "PASSED" "$OUT/tests-parallel.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/tests-parallel.log" | tail -30 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
