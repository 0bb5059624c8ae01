#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one command for a lent H100/H200 with the device's own torch.
#   bash examples/gpu_check.sh [OUT]        OUT: where logs and JSON records go (default $OUT or gpu-check)
# It installs the project offline (no package index needed), then runs the GPU tests and the benches
# whose figures docs/gpu.md reports, each under its own time limit. Every part writes its log and JSON
# as soon as it ends, and status.txt says which parts ran and how long they took, so a run cut short
# still reports what it finished; everything is also packed into OUT/gpu-check.tgz (one file).
#   PARTS="..."   which parts run, in this order (default: all of them):
#     kernel     the attention kernel against its float64 reference on CUDA
#     attention  one layer's attention against the HBM bound, with a sweep of the kernel's launch shapes;
#                the best at batch 1 and at batch 8 are exported (TLT_ATTENTION_TUNING) to every later part
#     profile    the kernels of plain and speculative steps by device time: Llama-8B at 32K, batch 8; the
#                demo target at 128 tokens, batch 1 and 4
#     b1         the Llama-8B step at LENGTHS (default 32768 16384 8192), batch 1, against the engine before
#                the kernel (--baseline); the 8K run adds the mixed-length batch
#     b8         the same at batch 8 (prefill of 8 long prompts, peak memory)
#     paged      the 32K step at batch 1 and 8 on a paged KV cache of 16-position blocks
#     memory     64 requests of 32K budgets for 60 s each on a paged and a static cache sized for 80 GB
#     arms       every speculative path at 32K (chain and tree, EAGLE and EAGLE-3, greedy and sampled)
#     tests      `pytest -m gpu`, twice in a row (a test past 100 s dumps every thread's stack to its log)
#     rollout    the demo target's SD/AR and tuner rollouts (tlt bench rollout)
#     shapes     the short-context step-cost rows and the graph-memory bench
# (The parts run in the order listed here, whatever the order in PARTS.)
# LOGS: where the logs and records are kept (default a new temporary folder; give the same one to two
# runs to pack both into one OUT/gpu-check.tgz). QUICK=1: the benches' --quick sizes (a smoke test, also
# on a CPU). TLT_CACHE (default ./.tlt_cache): the demo's trained target and warm-up drafter, carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$out" "$logs"
export TLT_CACHE=${TLT_CACHE:-$PWD/.tlt_cache}
parts=${PARTS:-kernel attention profile b1 b8 paged memory arms tests rollout shapes}
lengths=${LENGTHS:-32768 16384 8192}
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
tuned() {  # the sweep's best launch shapes (batch 1, batch 8), once the attention part recorded them
  [ -f "$logs/attention_gpu.json" ] && python -c "import json, sys
s = json.load(open(sys.argv[1])).get('sweep')
print(json.dumps({'few': s['few'][0]['tuning'], 'many': s['many'][0]['tuning']}) if s and 'few' in s else '')" \
  "$logs/attention_gpu.json"
}
if has kernel; then
  part attention-kernel 120 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_attention.py
fi
if has attention; then
  part attention 200 tlt -q bench attention --sweep "${quick[@]}" --json "$logs/attention_gpu.json"
fi
best=$(tuned)
[ -n "$best" ] && export TLT_ATTENTION_TUNING="$best" && echo "TLT_ATTENTION_TUNING=$best" | tee -a "$logs/status.txt"
if has profile; then
  prof=(--prompt-len 32768 --batch 8)
  [ "${QUICK:-0}" = 1 ] && prof=(--quick --batch 2)
  part profile-32k-b8 150 python examples/profile_step.py "${prof[@]}"
  for b in 1 4; do
    part "profile-demo-b$b" 90 python examples/profile_step.py --shape demo --prompt-len 128 --batch "$b" "${quick[@]}"
  done
fi
for b in 1 8; do
  has "b$b" || continue
  for n in $lengths; do
    extra=()
    [ "$b" = 1 ] && extra=(--baseline)
    [ "$b" = 1 ] && [ "$n" = 8192 ] && extra+=(--mixed)
    plen=(--prompt-len "$n")
    [ "${QUICK:-0}" = 1 ] && plen=()  # (the quick sizes' own prompt length)
    part "step-cost-llama-8b-${n}-b$b" 150 tlt -q bench step-cost "${long[@]}" "${plen[@]}" --batches "$b" \
      "${extra[@]}" --json "$logs/step_cost_llama8b_${n}_b${b}_gpu.json"
  done
done
if has paged; then
  n=${lengths%% *}
  paged=(--shape llama-8b --new-tokens 48 --prompt-len "$n")
  [ "${QUICK:-0}" = 1 ] && paged=(--shape demo --new-tokens 8 --prompt-len 2048)
  for b in 1 8; do
    part "step-cost-llama-8b-${n}-b$b-paged16" 150 tlt -q bench step-cost "${paged[@]}" --batches "$b" \
      --block-size 16 --json "$logs/step_cost_llama8b_${n}_b${b}_paged16_gpu.json"
  done
fi
if has memory; then
  mem=()
  [ "${QUICK:-0}" = 1 ] && mem=(--quick --seconds 3)
  part memory-window 200 python examples/memory_window.py "${mem[@]}" --json "$logs/memory_window_gpu.json"
fi
if has arms; then
  arms=()
  [ "${QUICK:-0}" = 1 ] && arms=(--quick)
  part arms-32k 150 python examples/long_context_arms.py "${arms[@]}" --json "$logs/long_context_arms_gpu.json"
fi
if has tests; then
  for i in 1 2; do
    part "pytest-gpu-$i" 300 python -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=100 tests/rollout tests/drafter tests/tlt/test_replica_engine.py
  done
fi
if has rollout; then
  part rollout 500 tlt -q bench rollout --repeats 1 "${quick[@]}" --json "$logs/rollout_gpu.json"
fi
if has shapes; then
  part step-cost-demo 60 tlt -q bench step-cost --shape demo "${quick[@]}" --json "$logs/step_cost_demo_gpu.json"
  if [ "${QUICK:-0}" != 1 ]; then
    part step-cost-llama-8b 90 tlt -q bench step-cost --shape llama-8b --repeats 3 --json "$logs/step_cost_llama8b_gpu.json"
  fi
  part graphs 90 tlt -q bench graphs "${quick[@]}" --json "$logs/graphs_gpu.json"
fi
echo "records in $out/gpu-check.tgz:"; tar tzf "$out/gpu-check.tgz"
