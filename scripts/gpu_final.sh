#!/usr/bin/env bash
# One H200 call for the evening merge: the new kernels' tests on the GPU, the hybrid mixed-graph check on the
# 80B shape (scripts/hybrid_graph_check.py), and the structured-output profile (scripts/structured_cost.py).
# Carry .whl (lamina's wheels + xgrammar) and .gpu (tokenizers). Each part has its own time limit.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mamba_ssd.py tests/kernels/test_triton_mamba_ssd.py \
  tests/kernels/test_mamba_ssd_graph_padding.py tests/kernels/test_mla_decode.py tests/kernels/test_quant_moe_gemm.py \
  tests/kernels/test_moe_decode.py tests/kernels/test_norm_gated_gemv.py tests/kernels/test_gdn_conv_decode.py \
  tests/kernels/test_triton_conv1d_verify.py tests/kernels/test_hybrid_graph_replay.py \
  tests/kernels/test_mamba2_model_triton.py tests/gpu/test_gpu_hybrid_graphs_80b_structure.py \
  > "$OUT/kernel_tests.log" 2>&1
echo "kernel tests rc $? in $((SECONDS - t0)) s"; grep -E "passed|failed|error" "$OUT/kernel_tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/kernel_tests.log" | head -20
t0=$SECONDS
timeout 250 python3 scripts/hybrid_graph_check.py --out "$OUT" > "$OUT/hybrid_graph_check.log" 2>&1
echo "hybrid graph check rc $? in $((SECONDS - t0)) s"; tail -n 15 "$OUT/hybrid_graph_check.log"
t0=$SECONDS
python3 -m lamina.cli bench save-random qwen3-0.6b /tmp/ck06 --tokenizer .gpu/tok > /dev/null 2>&1
timeout 100 python3 scripts/structured_cost.py --model /tmp/ck06 --batch 1,64 --output-len 96 \
  > "$OUT/structured_cost.log" 2>&1
echo "structured cost rc $? in $((SECONDS - t0)) s"; head -n 40 "$OUT/structured_cost.log"
