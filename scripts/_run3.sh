export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false LAMINA_TEST_TOKENIZER=$PWD/.gpu_a/tok PYTHONPATH=$PWD
OUT=${OUT:-./gpu_out}; mkdir -p $OUT
python3 -m pytest -q tests/kernels/test_triton_gdn_chunk.py tests/kernels/test_triton_moe.py tests/kernels/test_triton_gdn.py 2>&1 | tee $OUT/kernel_tests.log | grep -E "passed|failed|^FAILED" | head -20
python3 -m pytest -q -s tests/gpu/test_gpu_hybrid.py 2>&1 | tee $OUT/gpu_hybrid_tests.log | grep -E "passed|failed|^FAILED|^E |ours max" | head -30
python3 scripts/profile_decode.py --layers 4 --batch 1 --top 22 2>&1 | grep -v WARNING | tee $OUT/profile_decode_b1.txt | tail -26
python3 -m lamina.cli bench latency --model random:qwen3-next-80b-a3b-24l --input-len 128 --output-len 256 --max-num-seqs 64 \
  --baseline hf --result-file $OUT/latency_qwen3_next_24l.json 2>&1 | grep -vE "it/s|tensor/s|Loading" | tail -32
