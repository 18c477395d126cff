#!/usr/bin/env bash
# One device session's checks and A/B benchmarks: this checkout against an older lamina in .baseline/lamina
# (e.g. `git archive <commit> lamina | tar -x -C .baseline`), on the same GPU in the same call.
# Usage (repo root, on the GPU machine): OUT=dir scripts/gpu_session.sh check|bench1|bench2
#   check   all kernel and GPU tests, the mixed-graph check, the new-kernel bench (~8 min)
#   bench1  offline throughput (Qwen3-0.6B shape) and online serving at concurrency 64/256, new vs baseline
#   bench2  batch-1 decode (Qwen3-8B shape) and the shared-prefix workload, new vs baseline
#   hybrid  the 64-concurrent Qwen3-Next-80B-A3B (24 layers) workload, new vs baseline
# SIDES="new" runs only this checkout in the A/B modes.
# Packages the GPU image lacks travel as wheels in .whl (see scripts/gpu_remote_env.sh).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# `python3 -m` puts the working directory first on sys.path: each side runs from the directory holding its
# lamina package.
NEW=$PWD; OLD=$PWD/.baseline
SIDES=${SIDES:-old new}
[ -d .gpu/smoltok ] && export LAMINA_TEST_TOKENIZER=$PWD/.gpu/smoltok  # tests/gpu need a real tokenizer
what=${1:-check}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "$what" = check ]; then
  PYTHONPATH=$NEW timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
  PYTHONPATH=$NEW timeout 200 python3 scripts/gpu_graph_check.py --out "$OUT" --skip-eager-bench 2>&1 \
    | grep -vE "it/s|WARNING" | tee "$OUT/graph_check.log" | tail -25
  PYTHONPATH=$NEW timeout 150 python3 scripts/gpu_kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.log" | tail -30
fi

run_ab() {  # name, then the bench arguments: runs the baseline, then this checkout
  local name=$1; shift
  for side in $SIDES; do
    local dir=$OLD; [ $side = new ] && dir=$NEW
    (cd "$dir" && python3 -m lamina.cli bench "$@" --result-file "$OUT/${name}_$side.json" \
      > "$OUT/${name}_$side.log" 2>&1) || echo "$name $side: exit $?"
    python3 - "$OUT/${name}_$side.json" "$name $side" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no result:", e); sys.exit()
l = r.get("lamina", r)
keys = ("output_tok_s", "elapsed_s", "decode_tok_s", "ttft_s", "ttft_median_s", "speedup", "fraction_of_roofline")
print(sys.argv[2], {k: round(v, 4) for k, v in {**l, **r}.items() if k in keys and isinstance(v, (int, float))})
EOF
  done
}

serve_ab() {  # the serving workload of the throughput issue against `lamina serve`, baseline then new
  # One random Qwen3-0.6B checkpoint with the Qwen3 tokenizer (.gpu/tok), so streamed chunks carry text and
  # the client times the first token.
  local ck=/tmp/ck_qwen3_0.6b
  [ -d $ck ] || python3 -m lamina.cli bench save-random qwen3-0.6b $ck --tokenizer "$PWD/.gpu/tok" > /dev/null
  for side in old new; do
    local dir=$OLD; [ $side = new ] && dir=$NEW
    t0=$SECONDS
    (cd "$dir" && exec python3 -m lamina.cli serve $ck --port 8011 --max-num-seqs 256 \
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --no-enable-prefix-caching \
      > "$OUT/serve_$side.log" 2>&1) & local pid=$!
    for _ in $(seq 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 0.5; done
    echo "serve $side healthy after $((SECONDS - t0)) s"
    python3 -m lamina.cli bench serve --base-url http://127.0.0.1:8011 --num-prompts 512 \
      --input-len 512 --output-len 256 --max-concurrency 64,256 --vocab-size 151936 --num-warmups 8 \
      --num-clients 4 --disable-tqdm --result-file "$OUT/serve_$side.json" 2>&1 | tail -12
    kill -TERM $pid; wait $pid
  done
}

if [ "$what" = bench1 ]; then
  run_ab throughput throughput --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 512 \
    --max-num-seqs 256 --max-num-batched-tokens 8192
  serve_ab
fi
if [ "$what" = bench2 ]; then
  run_ab latency8b latency --model random:qwen3-8b --input-len 128 --output-len 256
  run_ab prefix prefix --model random:qwen3-0.6b --groups 16 --per-group 16 --prefix-len 4096 --question-len 128 \
    --output-len 128 --max-num-batched-tokens 8192
fi
if [ "$what" = hybrid ]; then
  run_ab hybrid throughput --model random:qwen3-next-80b-a3b-24l --num-prompts 64 --input-len 1024 \
    --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 8192
fi
if [ "$what" = profile ]; then  # per-step host/device/idle time (scripts/profile_steps.py), new code only
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 200 python3 scripts/profile_steps.py --out "$OUT/steps_dense.json" 2>&1 \
    | grep -vE "it/s|generating" | tail -6
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 200 python3 scripts/profile_steps.py --model random:qwen3-next-80b-a3b-24l \
    --num-prompts 64 --input-len 1024 --output-len 256 --max-num-seqs 64 --out "$OUT/steps_hybrid.json" 2>&1 \
    | grep -vE "it/s|generating" | tail -6
fi
if [ "$what" = attn ]; then  # paged decode attention: tile sweep + CUDA-core variant (scripts/attention_sweep.py)
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 400 python3 scripts/attention_sweep.py --quick --out "$OUT/attn_sweep.json" 2>&1 \
    | grep -v Warning | tail -45
fi
if [ "$what" = moe ]; then  # fused MoE: align kernel and grouped-GEMM tile sweep (scripts/moe_sweep.py)
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 400 python3 scripts/moe_sweep.py --out "$OUT/moe_sweep.json" 2>&1 \
    | grep -v Warning | tail -30
fi
if [ "$what" = tests ]; then  # every kernel and GPU test on the merged code, failures listed (no -x)
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 540 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels tests/gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40
fi
if [ "$what" = hybgraphs ]; then  # hybrid mixed-step graphs: correctness (tiny fp32/bf16) and the 80b A/B
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 560 python3 scripts/gpu_graph_check.py --hybrid --out "$OUT" 2>&1 \
    | grep -vE "it/s|WARNING" | tee "$OUT/hybrid_graph_check.log" | tail -40
fi
if [ "$what" = perf ]; then  # this checkout's offline figures, then the FP8 and 4-bit kernel benches
  SIDES=new
  run_ab throughput throughput --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 512 \
    --max-num-seqs 256 --max-num-batched-tokens 8192
  run_ab hybrid throughput --model random:qwen3-next-80b-a3b-24l --num-prompts 64 --input-len 1024 \
    --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 8192
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 150 python3 scripts/fp8_gpu_bench.py 2>&1 | tee "$OUT/fp8_gpu_bench.log" | tail -25
  PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 150 python3 scripts/gpu_wq_bench.py 2>&1 | tee "$OUT/wq_bench.log" | tail -25
fi
