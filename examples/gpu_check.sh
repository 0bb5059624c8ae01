#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one command for a lent H100/H200 with the device's own torch.
#   bash examples/gpu_check.sh [OUT]        OUT: where logs and JSON records go (default $OUT or gpu-check)
# It installs the project offline (no package index needed), then runs the GPU tests and the benches
# whose figures docs/gpu.md reports, each under its own time limit. Every part writes its log and JSON
# as soon as it ends, and status.txt says which parts ran and how long they took, so a run cut short
# still reports what it finished; everything is also packed into OUT/gpu-check.tgz (one file).
#   PARTS="long tests rollout shapes"   which groups run, in this order (default: all):
#     long    the long-context checks: attention alone against the HBM bound, the Llama-8B step at
#             8K/16K/32K (batch 1 against the engine before the kernel, batch 8, a mixed-length batch),
#             every speculative path at 32K
#     tests   `pytest -m gpu`, twice in a row in one process each
#     rollout the demo target's SD/AR and tuner rollouts (tlt bench rollout)
#     shapes  the short-context step-cost rows and the graph-memory bench
# QUICK=1: the benches' --quick sizes (a smoke test, also on a CPU).
# TLT_CACHE (default ./.tlt_cache): the demo's trained target and warm-up drafter, carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
logs=$(mktemp -d)
mkdir -p "$out"
export TLT_CACHE=${TLT_CACHE:-$PWD/.tlt_cache}
parts=${PARTS:-long tests rollout shapes}
quick=()
[ "${QUICK:-0}" = 1 ] && quick=(--quick)
long=(--shape llama-8b --new-tokens 48)
[ "${QUICK:-0}" = 1 ] && long=(--shape demo --quick)

part() {  # part NAME LIMIT_S CMD...: run one part, log it, record its status
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name: $*"
  t0=$(date +%s)
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$logs/status.txt"
  tail -n 14 "$logs/$name.log"
  tar czf "$out/gpu-check.tgz" -C "$logs" . && cp "$logs/status.txt" "$out/status.txt"
}
has() { [[ " $parts " == *" $1 "* ]]; }

python -c "import tlt.rollout" 2>/dev/null || \
  part install 120 python -m pip install --no-deps --no-build-isolation -e .
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$logs/device.txt"
if has long; then
  part attention-kernel 120 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_attention.py
  part attention 150 tlt -q bench attention "${quick[@]}" --json "$logs/attention_gpu.json"
  for n in 32768 16384 8192; do
    extra=()
    [ "$n" = 8192 ] && extra=(--mixed)
    part "step-cost-llama-8b-${n}-b1" 120 tlt -q bench step-cost "${long[@]}" --prompt-len "$n" --batches 1 \
      --baseline "${extra[@]}" --json "$logs/step_cost_llama8b_${n}_b1_gpu.json"
    part "step-cost-llama-8b-${n}-b8" 150 tlt -q bench step-cost "${long[@]}" --prompt-len "$n" --batches 8 \
      --json "$logs/step_cost_llama8b_${n}_b8_gpu.json"
  done
  arms=()
  [ "${QUICK:-0}" = 1 ] && arms=(--quick)
  part arms-32k 150 python examples/long_context_arms.py "${arms[@]}" --json "$logs/long_context_arms_gpu.json"
fi
if has tests; then
  for i in 1 2; do
    part "pytest-gpu-$i" 240 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout tests/tlt/test_replica_engine.py
  done
fi
if has rollout; then
  part rollout 240 tlt -q bench rollout --repeats 1 "${quick[@]}" --json "$logs/rollout_gpu.json"
fi
if has shapes; then
  part step-cost-demo 60 tlt -q bench step-cost --shape demo "${quick[@]}" --json "$logs/step_cost_demo_gpu.json"
  if [ "${QUICK:-0}" != 1 ]; then
    part step-cost-llama-8b 90 tlt -q bench step-cost --shape llama-8b --repeats 3 --json "$logs/step_cost_llama8b_gpu.json"
  fi
  part graphs 90 tlt -q bench graphs "${quick[@]}" --json "$logs/graphs_gpu.json"
fi
echo "records in $out/gpu-check.tgz:"; tar tzf "$out/gpu-check.tgz"
