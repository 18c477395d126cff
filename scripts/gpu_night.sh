#!/usr/bin/env bash
# One H200 call for the night merge: each helper's GPU script with its own time limit, every output packed
# into one archive (a call returns at most 8 files). Carry .whl (lamina's wheels) and .gpu (tokenizers, text).
# Usage (repo root, on the GPU machine): OUT=dir scripts/gpu_night.sh [stage ...]   (default: all stages)
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT/night"; OUT=$(cd "$OUT" && pwd); N=$OUT/night
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$N/pip.log" 2>&1 || tail -3 "$N/pip.log"
# Later calls of one warm machine carry less: what came once is kept in /tmp/keep (outside the repo copy).
mkdir -p /tmp/keep; [ -d .gpu ] && cp -r .gpu /tmp/keep/; [ -d .gpu ] || ln -s /tmp/keep/.gpu .gpu
export PYTHONPATH=$PWD:/tmp/site XDG_CACHE_HOME=$PWD/.gpu/xdg
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
stage() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS; mkdir -p "$N/$name"
  OUT=$N/$name timeout "$limit" "$@" > "$N/$name.log" 2>&1
  echo "===== $name: rc $? in $((SECONDS - t0)) s ====="
  tail -n "${TAIL:-25}" "$N/$name.log"
}
all=("$@")
sel() { [ ${#all[@]} -eq 0 ] || [[ " ${all[*]} " == *" $1 "* ]]; }
sel attention && stage attention ${ATT_S:-90} bash -c 'python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py tests/kernels/test_triton_graph_attention.py tests/kernels/test_attention_softcap.py 2>&1 | tail -3; python3 scripts/gpu_attention_bench.py --out "$OUT"'
sel spec && stage spec ${SPEC_S:-130} python3 scripts/gpu_spec_bench.py --only ${SPEC_ONLY:-check_hybrid} --budget-s $(( ${SPEC_S:-130} - 10 ))
sel structured && stage structured ${ST_S:-270} bash scripts/gpu_vllm.sh structured
# Issue 16 (struct6): plain and schema TPOT interleaved, 2 repeats at c = 1 and 64 (~4.5 min), the default fill vs
# the opt-in LAMINA_GRAMMAR_FILL_PIPE path with LAMINA_GRAMMAR_FILL_SWITCH_US=200 (pipesw; structured/fill_pipe.py:
# one batch accept and one batch fill on a worker the loop does not wait for) switched inside one server, with the
# phases (gpu_vllm.sh structured says more). ST6_FILLS=default,pipesw,pipe,pipeloop ST6_S=420: the pipe with
# Python's 5 ms switch interval and with the batch accept on the loop too.
sel struct6 && stage struct6 ${ST6_S:-300} env FILLS=${ST6_FILLS:-default,pipesw} REPEATS=${ST6_REPEATS:-2} \
  bash scripts/gpu_vllm.sh structured
# Issue 16 (struct7): as struct6 (~4.5 min), the default fill against JSON whitespace bounded on the host with the
# pipe (wspipe: LAMINA_JSON_WHITESPACE_ON_HOST=1, structured/whitespace.py: the grammar's bound made each fill ~4x
# dearer; LAMINA_GRAMMAR_FILL_PIPE=1), switched inside one server. ST7_FILLS=default,ws,wspipe,wsnofill ST7_S=540:
# the host bound with the default fill and with every fill on the loop (one xgrammar thread) too.
sel struct7 && stage struct7 ${ST7_S:-300} env FILLS=${ST7_FILLS:-default,wspipe} REPEATS=${ST7_REPEATS:-2} \
  bash scripts/gpu_vllm.sh structured
sel families && stage families ${FAM_S:-300} python3 scripts/gpu_families_bench.py --budget-s $(( ${FAM_S:-300} - 10 )) \
  ${FAM_ONLY:+--only $FAM_ONLY}
# Issue 15's kernel targets (batch-1 decode FP8 / W4A16 / Q4_K vs bf16, FP8 prefill MFU, FP8 KV attention,
# quantized MoE GEMMs, then 256-request offline throughput bf16 vs FP8 if the budget has room).
sel quant && stage quant ${QT_S:-300} python3 scripts/quant_targets.py --throughput --budget $(( ${QT_S:-300} - 10 ))
# The two perplexity rows the 2026-12-02 call had no budget for (needs $LAMINA_SMOLLM2_GGUF: the GGUF in parts).
sel qrows && stage qrows ${QR_S:-150} python3 scripts/gpu_quant_quality.py --budget $(( ${QR_S:-150} - 10 )) \
  --only fp32,int4-gptq-g32-mse,int4-gptq-g32-in-order
# DeepSeek (MLA) mixed steps through captured graphs == eager; its cold Triton compile alone ran past 90 s.
sel mla && stage mla ${MLA_S:-180} python3 scripts/mla_graph_check.py --json "$N/mla/mla-graph.json"
# The offline bench's decode step (256 sequences of ~800 tokens, Qwen3-0.6B shape) op by op (issues 12, 13).
sel prof06 && stage prof06 90 python3 scripts/profile_decode.py --model random:qwen3-0.6b --batch 256 --input-len 800 \
  --steps 16 --kv-cache-memory-gb 40 --json "$N/prof06/profile_qwen3_06b_b256.json"
# Issue 14's real-weight rows: SmolLM2 with ngram / self_spec on the GPU (needs $LAMINA_SMOLLM2_GGUF).
sel smolspec && stage smolspec ${SS_S:-420} bash scripts/gpu_smol_spec.sh
# The afternoon's kernel rewrites (2026-12-02): every FP8 decode GEMV variant and the fused activation
# quantization, then the dense layer with its GEMV prologues (fused vs separate, graph replay, launches).
sel fp8sweep && stage fp8sweep ${F8_S:-115} python3 scripts/fp8_gpu_bench.py --quick --sweep
# Issue 15's skinny FP8 decode GEMM (triton_fp8_skinny.py, fp87): every-code / wide-row / graph-replay checks
# and each Qwen3-8B shape's default vs fp64 first, then M = 1, 2, 4, 8, 16: bf16, old GEMV default, tc16, tc, the
# block128 config sweep at M = 1 and 16, the 36-layer sums per M (LAMINA_FP8_SKINNY=tc16 switches it on).
sel fp8skinny && stage fp8skinny ${FS_S:-240} python3 scripts/fp8_skinny_bench.py --budget $(( ${FS_S:-240} - 40 ))
sel densestep && stage densestep ${DS_S:-170} bash -c 'python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_epilogue.py tests/kernels/test_decode_prep.py tests/kernels/test_gemv_prologue.py 2>&1 | tail -3; python3 scripts/gpu_dense_step.py --steps ${DS_STEPS:-48}'
sel densecheck && stage densecheck ${DC_S:-115} python3 scripts/gpu_dense_decode_check.py --tune
sel specdense && stage specdense ${SD_S:-115} python3 scripts/gpu_spec_bench.py --only check_dense,forced_dense \
  --budget-s $(( ${SD_S:-115} - 5 ))
sel wqsweep && stage wqsweep ${WQ_S:-130} python3 scripts/gpu_wq_bench.py --quick --sweep
# Issue 15's 4-bit decode linears: every path wq_dispatch may pick checked first, then bf16 / old default /
# new default / the dispatcher's timed picks per Qwen3-8B shape and as the 36-layer step, M = 1, 2, 4, 8, 16
# (LAMINA_WQ_GEMV=repack builds the kn copy in the models; LAMINA_WQ_TUNE=0 keeps the untimed picks).
sel wqkn && stage wqkn ${WK_S:-240} python3 scripts/gpu_wq_kn_bench.py --budget $(( ${WK_S:-240} - 45 ))
sel moesweep && stage moesweep ${MS_S:-120} python3 scripts/moe_decode_sweep.py --budget $(( ${MS_S:-120} - 20 ))
# The defaults set from the sweeps above (FP8 GEMV and blockwise _scaled_mm through fp8_linear).
sel fp8check && stage fp8check ${FC_S:-40} python3 scripts/fp8_default_check.py
# Issue 15's FP8 KV target: the FP8 KV kernels checked on the GPU, decode attention bf16 vs FP8 cache at
# (64, 4k), (256, 800), (1, 32k), then bf16 vs FP8 KV on a decode-heavy KV-bound workload (random Qwen3-8B, a
# 7 GiB pool, 80 prompts of 1-2k with 1-1.5k out). KV8_ARGS: e.g. "--num-prompts 64" if it runs long.
sel kvfp8 && stage kvfp8 ${KV8_S:-240} env LAMINA_FP8_V_WORDS=${KV8_WORDS:-0} python3 scripts/gpu_kv_fp8.py --budget $(( ${KV8_S:-240} - 8 )) ${KV8_ARGS:-}
# Hybrid verify forward vs decode forward, op by op (batch 1, eager, 8 layers of the 80B-A3B shape; issue 14).
sel specprof && stage specprof ${SP_S:-120} python3 scripts/spec_verify_profile.py --layers ${SP_LAYERS:-8}
# Issue 14's goodput gate (specgate): forced-acceptance Qwen3-8B at batch 1 and 64, p = 0.8 / 0.0 / 0.5, gate off
# vs goodput, each against plain in the same engine (scripts/gpu_spec_gate.py).
sel specgate && stage specgate ${SG_S:-240} python3 scripts/gpu_spec_gate.py ${SG_ARGS:-}
(cd "$OUT" && tar czf night.tgz night)
ls -la "$OUT/night.tgz"
