#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one command for a lent H100/H200 with the device's own torch.
#   bash examples/gpu_check.sh [OUT]        OUT: where logs and JSON records go (default $OUT or gpu-check)
# It installs the project offline (no package index needed), then runs the GPU tests and the benches
# whose figures docs/gpu.md reports, each under its own time limit. Every part writes its log and JSON
# as soon as it ends, and status.txt says which parts ran and how long they took, so a run cut short
# still reports what it finished. QUICK=1: the benches' --quick sizes (a smoke test, also on a CPU).
# TLT_CACHE (default ./.tlt_cache): the demo's trained target and warm-up drafter, carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export TLT_CACHE=${TLT_CACHE:-$PWD/.tlt_cache}
quick=()
[ "${QUICK:-0}" = 1 ] && quick=(--quick)

part() {  # part NAME LIMIT_S CMD...: run one part, log it, record its status
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name: $*"
  t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$out/status.txt"
  tail -n 12 "$out/$name.log"
}

python -c "import tlt.rollout" 2>/dev/null || \
  part install 120 python -m pip install --no-deps --no-build-isolation -e .
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$out/device.txt"
part pytest-gpu 150 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout tests/tlt/test_replica_engine.py
part step-cost-demo 60 tlt -q bench step-cost --shape demo "${quick[@]}" --json "$out/step_cost_demo.json"
part rollout 150 tlt -q bench rollout --repeats 1 "${quick[@]}" --json "$out/rollout.json"
if [ "${QUICK:-0}" != 1 ]; then
  part step-cost-qwen2-1.5b 60 tlt -q bench step-cost --shape qwen2-1.5b --repeats 3 --json "$out/step_cost_qwen2_1.5b.json"
  part step-cost-llama-8b 90 tlt -q bench step-cost --shape llama-8b --repeats 3 --json "$out/step_cost_llama8b.json"
  part step-cost-llama-8b-curve 200 tlt -q bench step-cost --shape llama-8b --batches 1,8,32,64,128,256 \
    --repeats 2 --json "$out/step_cost_llama8b_curve_gpu.json"
  part step-cost-llama-8b-4k 90 tlt -q bench step-cost --shape llama-8b --prompt-len 4096 --repeats 2 \
    --json "$out/step_cost_llama8b_4k.json"
fi
part graphs 90 tlt -q bench graphs "${quick[@]}" --json "$out/graphs.json"
echo "records in $out:"; ls "$out"
