#!/bin/bash
# Every GPU test in three pytest processes on one GPU (then the A/B tests alone), and optionally
# compare.py workloads after them. Results under ${OUT:-/tmp/gpu_check}; about 90 s of tests on an
# H100 (16 cores). Usage: bash benchmarks/gpu_check.sh [WORKLOAD ...]   e.g. bash benchmarks/gpu_check.sh minilm
# (the run that issue 13 still lacks: MiniLM fp16 b32 s128 against torch.compile max-autotune).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
R=${OUT:-/tmp/gpu_check}; mkdir -p "$R"
PT="python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX"
K=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_families -e test_conv -e test_ab_gpu \
    -e test_e2e_gpu -e test_generation_gpu -e test_runtime_gpu -e test_counters_gpu -e test_hostile_gpu \
    -e test_plan_contracts -e test_report_gpu -e test_cli_ -e test_softcap_generation)
RT="tests/test_e2e_gpu.py tests/test_generation_gpu.py tests/test_runtime_gpu.py tests/test_counters_gpu.py
    tests/test_hostile_gpu.py tests/test_plan_contracts.py tests/test_report_gpu.py tests/test_cli_doctor.py
    tests/test_cli_validate.py tests/test_softcap_generation.py"
F="tests/test_families_llm.py tests/test_families_vision.py tests/test_conv.py"
# GPU_PARTS (default all): which of the four processes run. The kernels alone took 543 s of a 600 s device call
# (H200, thirty-fifth session): run "kernels" in one call and "runtime families ab" in another where they do not fit.
PARTS=" ${GPU_PARTS:-kernels runtime families ab} "
KN=$([ "$PARTS" = " kernels " ] && echo 8 || echo 5)  # alone, the kernels take more workers
[[ $PARTS == *" kernels "* ]] && ( $PT -n $KN $K > "$R/t_kernels.txt" 2>&1; echo "rc=$?" >> "$R/t_kernels.txt" ) &
[[ $PARTS == *" runtime "* ]] && ( $PT -n 3 $RT > "$R/t_runtime.txt" 2>&1; echo "rc=$?" >> "$R/t_runtime.txt" ) &
[[ $PARTS == *" families "* ]] && ( $PT -n 4 $F > "$R/t_families.txt" 2>&1; echo "rc=$?" >> "$R/t_families.txt" ) &
wait
if [[ $PARTS == *" ab "* ]]; then $PT tests/test_ab_gpu.py > "$R/t_ab.txt" 2>&1; echo "rc=$?" >> "$R/t_ab.txt"; fi
tail -n 2 "$R"/t_*.txt
for w in "$@"; do
  python3 benchmarks/compare.py "$w" --json "$R/compare_$w.json" > "$R/compare_$w.txt" 2>&1
  grep -v '^partial\|^{"peaks' "$R/compare_$w.txt" | tail -n 4
done
