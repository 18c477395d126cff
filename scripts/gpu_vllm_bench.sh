#!/usr/bin/env bash
# lamina and vLLM side by side on one GPU: each bench with --baseline vllm runs lamina, then vLLM in a child
# process on the same token-id workload and the same shape (random: presets -> vLLM's dummy weights), and
# writes both and the ratio to one JSON file in $OUT.
# Usage (GPU machine, repo root), after installing vLLM into /tmp/site (../shared/peers/vllm/README.md):
#   source $W/env.sh            # PYTHONPATH=/tmp/site:..., VLLM_USE_FLASHINFER_SAMPLER=0, offline switches
#   OUT=... scripts/gpu_vllm_bench.sh [throughput|latency|prefix|client|serve|all]
# Sections, each meant to fit one 10-minute device call (vLLM's first start compiles and captures graphs,
# about 1-2.5 min of each):
#   throughput  Qwen3-0.6B shape, 256 prompts, input U[100,1024], 512 out, 256 seqs, 8192-token steps
#   latency     Qwen3-8B shape, batch 1, 128-token prompt, 256 out (TTFT and decode tok/s, median of 3)
#   prefix      Qwen3-0.6B shape, 16 groups x 16 requests sharing a 4,096-token prefix, 128-token questions,
#               128 out; lamina with its prefix cache on and off, vLLM with its prefix cache on
#   client      the load client's own ceiling against a fake server (no GPU work), 1 and 4 client processes
#   serve       (not in all; needs QWEN3_TOKENIZER=a Qwen3 tokenizer dir) vllm serve and lamina serve on one
#               random Qwen3-0.6B checkpoint, loaded by `lamina bench serve` with 4 client processes
# all: throughput, latency, prefix, client (about 12-15 min: split it over two calls).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"   # after /tmp/site: lamina from this checkout
python3 -c "import vllm, sys; print('vllm', vllm.__version__, 'python', sys.version.split()[0])" 2>&1 | tail -1 \
  | tee "$OUT/vllm_version.txt"
python3 -c "import vllm" 2>/dev/null || { echo "vLLM is not importable: source \$W/env.sh first"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
B="python3 -m lamina.cli bench"
what=${1:-all}
quiet() { grep -vE "it/s\]|tensor/s|Processed prompts" | tail -"${1:-60}"; }

if [ "$what" = throughput ] || [ "$what" = all ]; then
  $B throughput --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 512 \
     --max-num-seqs 256 --max-num-batched-tokens 8192 --baseline vllm \
     --result-file "$OUT/vllm_throughput_qwen3_0.6b.json" 2>&1 | tee "$OUT/vllm_throughput_qwen3_0.6b.log" | quiet
fi
if [ "$what" = latency ] || [ "$what" = all ]; then
  # 8 sequences: batch-1 decode does not use more, and vLLM then captures far fewer graph sizes.
  $B latency --model random:qwen3-8b --input-len 128 --output-len 256 --max-num-seqs 8 --baseline vllm \
     --result-file "$OUT/vllm_latency_qwen3_8b.json" 2>&1 | tee "$OUT/vllm_latency_qwen3_8b.log" | quiet
fi
if [ "$what" = prefix ] || [ "$what" = all ]; then
  $B prefix --model random:qwen3-0.6b --groups 16 --per-group 16 --prefix-len 4096 --question-len 128 \
     --output-len 128 --max-num-batched-tokens 8192 --baseline vllm \
     --result-file "$OUT/vllm_prefix_qwen3_0.6b.json" 2>&1 | tee "$OUT/vllm_prefix_qwen3_0.6b.log" | quiet
fi
if [ "$what" = client ] || [ "$what" = all ]; then
  # The serving workload of the throughput issue against a server that costs (almost) nothing per token:
  # what the client sustains must exceed both real servers' output tok/s.
  for nc in 1 4; do
    $B serve --fake-server --fake-server-workers 4 --num-prompts 512 --input-len 512 --output-len 256 \
       --max-concurrency 64,256 --vocab-size 151936 --num-warmups 8 --num-clients $nc --disable-tqdm \
       --result-file "$OUT/client_ceiling_${nc}proc.json" 2>&1 | tee "$OUT/client_ceiling_${nc}proc.log" \
       | grep -E "concurrency|Output token|TPOT|TTFT|Client|Failed"
  done
fi
if [ "$what" = serve ]; then
  : "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory (tokenizer.json, ...)}"
  CK=/tmp/qwen3-0.6b-random
  [ -f $CK/config.json ] || $B save-random qwen3-0.6b $CK --tokenizer "$QWEN3_TOKENIZER"
  LIMITS="--max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --no-enable-prefix-caching"
  LOAD="--num-prompts 512 --input-len 512 --output-len 256 --max-concurrency 64,256 --vocab-size 151936
        --num-warmups 8 --num-clients 4 --disable-tqdm"
  wait_up() {  # up to 5 minutes for /health to answer 200
    python3 - "$1" <<'PY'
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
  }
  t0=$SECONDS
  vllm serve $CK --port 8010 $LIMITS > "$OUT/vllm_serve.log" 2>&1 & VPID=$!
  wait_up 8010 && echo "vllm serve healthy after $((SECONDS - t0)) s" | tee "$OUT/vllm_startup.txt" \
    || { echo "vllm serve did not come up: $OUT/vllm_serve.log"; tail -20 "$OUT/vllm_serve.log"; }
  $B serve --base-url http://127.0.0.1:8010 $LOAD --result-file "$OUT/serve_vllm.json" 2>&1 \
    | grep -E "concurrency|Output token|TPOT|TTFT|Client|Failed"
  kill $VPID; wait $VPID 2>/dev/null; sleep 5   # its engine-core process gives the GPU memory back
  t0=$SECONDS
  python3 -m lamina.cli serve $CK --port 8011 $LIMITS > "$OUT/lamina_serve.log" 2>&1 & LPID=$!
  wait_up 8011 && echo "lamina serve healthy after $((SECONDS - t0)) s" | tee "$OUT/lamina_startup.txt" \
    || { echo "lamina serve did not come up: $OUT/lamina_serve.log"; tail -20 "$OUT/lamina_serve.log"; }
  $B serve --base-url http://127.0.0.1:8011 $LOAD --result-file "$OUT/serve_lamina.json" 2>&1 \
    | grep -E "concurrency|Output token|TPOT|TTFT|Client|Failed"
  kill $LPID; wait $LPID 2>/dev/null
fi
for f in "$OUT"/vllm_*.json; do
  [ -f "$f" ] && python3 - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
v = r.get("vllm", {})
if "error" in v:
    print(f"{sys.argv[1]}: vLLM failed: {v['error']}")
else:
    keys = [k for k in r if k.startswith("ratio")]
    print(sys.argv[1], {k: round(r[k], 3) for k in keys})
EOF
done
exit 0
