#!/usr/bin/env bash
# vLLM 0.26.0 side by side with lamina on the GPU machine, in the same device call per workload.
# The kit (../shared/peers/vllm/fetch.sh OUTDIR) is six parts of <= 61 MiB; each device call carries one
# (as .vkit/partN, git-ignored) and `stage N` copies it to /tmp/vw, which survives while the machine stays warm.
# Usage (repo root, on the GPU machine): OUT=dir scripts/gpu_vllm.sh stage N | install | offline | hybrid |
#   serve | prefix | latency        (install once after the six stages; the rest run vLLM, then lamina)
#   structured                      (lamina only: scripts/structured_serve_cost.py on the GPU)
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
what=${1:-}
if [ "$what" = stage ]; then
  mkdir -p /tmp/vw && cp -r ".vkit/part$2/." /tmp/vw/ && du -sh /tmp/vw; exit
fi
if [ "$what" = install ]; then
  W=/tmp/vw SITE=/tmp/vsite bash /tmp/vw/install.sh 2>&1 | tail -3
  mkdir -p /tmp/keep && cp -r .gpu /tmp/keep/ 2>/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  exit
fi
# vLLM's kit first (its pydantic/fastapi/msgspec/zmq are what vLLM was built with), lamina's wheels after.
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/vsite/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1

bench() {  # name, then the bench arguments (with --baseline vllm)
  local name=$1; shift
  python3 -m lamina.cli bench "$@" --result-file "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?"
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no result:", e); sys.exit()
keys = ("output_tok_s", "elapsed_s", "decode_tok_s", "ttft_s", "ttft_median_s", "startup_s")
pick = lambda d: {k: round(v, 4) for k, v in d.items() if k in keys and isinstance(v, (int, float))}
print(sys.argv[2], "lamina", pick(r.get("lamina", r)), "vllm", pick(r.get("vllm", {})), "ratio", r.get("ratio"))
PY
}

case "$what" in
offline) bench thr06 throughput --model random:qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 512 \
  --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 8192 --baseline vllm ;;
hybrid) bench next64 throughput --model random:qwen3-next-80b-a3b-24l --num-prompts 64 --input-len 1024 \
  --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 4096 \
  --gpu-memory-utilization 0.9 --baseline vllm ;;
prefix) bench prefix06 prefix --model random:qwen3-0.6b --groups 16 --per-group 16 --prefix-len 4096 \
  --question-len 128 --output-len 128 --max-num-batched-tokens 8192 --baseline vllm ;;
latency) bench lat8b latency --model random:qwen3-8b --input-len 128 --output-len 256 --baseline vllm ;;
serve)
  ck=/tmp/ck_qwen3_0.6b; tok=/tmp/keep/.gpu/tok; [ -d .gpu/tok ] && tok=$PWD/.gpu/tok
  [ -d $ck ] || python3 -m lamina.cli bench save-random qwen3-0.6b $ck --tokenizer "$tok" > /dev/null
  for side in vllm lamina; do
    t0=$SECONDS
    if [ $side = vllm ]; then
      vllm serve $ck --port 8011 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 \
        --no-enable-prefix-caching > "$OUT/serve_$side.log" 2>&1 & pid=$!
    else  # lamina's own wheels first: the kit's older xgrammar would shadow the batch mask fill
      PYTHONPATH=$PWD:/tmp/site:/tmp/vsite python3 -m lamina.cli serve $ck --port 8011 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.85 --no-enable-prefix-caching > "$OUT/serve_$side.log" 2>&1 & pid=$!
    fi
    for _ in $(seq 400); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 0.5; done
    echo "serve $side healthy after $((SECONDS - t0)) s"
    python3 -m lamina.cli bench serve --base-url http://127.0.0.1:8011 --num-prompts 512 \
      --input-len 512 --output-len 256 --max-concurrency 64,256 --vocab-size 151936 --num-warmups 8 \
      --num-clients 4 --disable-tqdm --result-file "$OUT/serve_$side.json" 2>&1 | tail -8
    if [ $side = lamina ]; then  # issue 16: TPOT with a JSON schema against unconstrained, batch 1 and 64
      for c in 1 64; do
        n=$(( c == 1 ? 12 : 256 ))
        for schema in none scripts/schemas/bench_items.json; do
          extra=(); [ $schema != none ] && extra=(--json-schema $schema)
          tag=$([ $schema = none ] && echo plain || echo schema)
          python3 -m lamina.cli bench serve --base-url http://127.0.0.1:8011 --num-prompts $n --input-len 512 \
            --output-len 256 --max-concurrency $c --vocab-size 151936 --num-warmups 2 --disable-tqdm \
            "${extra[@]}" --result-file "$OUT/structured_${tag}_c$c.json" 2>&1 | grep -i "tpot\|output tok" | head -3
        done
      done
    fi
    kill -TERM $pid; wait $pid
    echo "serve $side exit $?"
  done
  # The load client's own ceiling (4 client processes against a trivial streaming server, same workload).
  python3 -m lamina.cli bench serve --fake-server --fake-server-workers 4 --num-prompts 512 --input-len 512 \
    --output-len 256 --max-concurrency 256 --vocab-size 151936 --num-clients 4 --disable-tqdm \
    --result-file "$OUT/serve_client_ceiling.json" 2>&1 | tail -4 ;;
structured)  # issue 16: the constrained step phase by phase on the real server path (lamina only, ~4 min)
  ck=/tmp/ck_qwen3_0.6b; tok=/tmp/keep/.gpu/tok; [ -d .gpu/tok ] && tok=$PWD/.gpu/tok
  [ -d $ck ] || python3 -m lamina.cli bench save-random qwen3-0.6b $ck --tokenizer "$tok" > /dev/null
  # The sampler's bitmask kernel (Triton, compiled) against the torch reference first.
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_bitmask_kernel.py 2>&1 \
    | tee "$OUT/bitmask_kernel_tests.log" | tail -2
  # One server; the fill variants (structured_serve_cost.py VARIANTS: default = the server's own settings;
  # loop = the opt-in path: the loop takes the tokens, no wait for the worker, switch interval 200 us while a
  # fill is pending, even one row in the background; min1; nofill; pipe = LAMINA_GRAMMAR_FILL_PIPE, pipeloop,
  # pipesw) switched between runs, and plain and schema
  # runs interleaved REPEATS times at c = 1 and 64 (order alternating, one uncounted run first); then per
  # variant a TPOT table (median [min-max], overhead) and the phases. FILLS=default,loop REPEATS=3: ~4 min.
  python3 scripts/structured_serve_cost.py --model $ck --device cuda --input-len 512 --output-len 256 \
    --tokenizer "$tok" --repeats ${REPEATS:-3} --variants ${FILLS:-default,loop} \
    --result-file "$OUT/structured_phases.json" 2>&1 | tee "$OUT/structured_runs.log" | grep -v "^c=" | tail -24
  cp /tmp/lamina_struct_serve.log "$OUT/structured_serve.log" 2>/dev/null ;;
*) echo "usage: scripts/gpu_vllm.sh stage N | install | offline | hybrid | serve | prefix | latency | structured"; exit 2 ;;
esac
