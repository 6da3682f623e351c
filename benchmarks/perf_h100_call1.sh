#!/bin/bash
# Device call 1 of the perf helper (issue 13): GPU tests of the new paths and the models they change,
# epilogue before/after with per-kernel profiles and host enqueue costs, compare.py on GPT-2 small.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
timeout 140 python -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_epilogue_lt.py tests/test_run_bound.py \
  tests/test_bench_per_kernel.py tests/test_e2e_gpu.py tests/test_runtime_gpu.py -k "not hf_export" 2>&1 | tail -25 | tee $OUT/gpu_tests.txt
timeout 140 python benchmarks/epilogue_ab.py $OUT/epilogue_ab.json 2>&1 | tee $OUT/epilogue_ab.txt
timeout 160 python benchmarks/compare.py gpt2-small --json $OUT/compare_gpt2.json 2>&1 | grep -v '^{"peaks' | tee $OUT/compare_gpt2.txt
timeout 110 python benchmarks/compare.py minilm bert-base qwen3-prefill --no-autotune --budget-s 100 --json $OUT/compare_rest.json 2>&1 | grep -v '^{"peaks' | tee $OUT/compare_rest.txt
