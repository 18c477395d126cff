export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-./gpu_out}; mkdir -p $OUT
python3 scripts/profile_decode.py --layers 4 --batch 1 --top 12 2>&1 | grep -v WARNING | tee $OUT/profile_decode_b1.txt | grep -E "graph|eager|gemv|profiled"
bash scripts/gpu_run.sh hybrid-bench 2>&1 | grep -vE "^\s+\"|^\{|^\}" | tail -30
for f in $OUT/latency_qwen3_next_24l.json $OUT/throughput_qwen3_next_24l.json; do python3 -c "
import json,sys; r=json.load(open('$f')); print('$f', {k: r.get(k) for k in ['lamina','hf','ratio_decode_tok_s','ratio_output_tok_s','fraction_of_roofline','roofline_tok_s','weight_bytes_per_token','state_bytes_per_token','prefill_mfu']})"; done
bash scripts/gpu_run.sh hybrid-prefix 2>&1 | grep -E "ttft_median|prefill_reduction|snapshot_hits|elapsed|prefill_tokens|Error|error" | tail -30
