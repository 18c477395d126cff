# Source this (". scripts/gpu_remote_env.sh") before scripts/gpu_run.sh on a lent GPU machine that cannot
# reach a package index or carry large files: it installs wheels carried in .whl/ (gguf, ...), points the
# tests at a tokenizer carried in .gpu_a/tok, and joins the SmolLM2 GGUF (98 MB, over one call's 64 MiB
# transfer) from its two halves, which travel in two calls of one warm machine (the first half is parked
# outside the repo copy, which each call replaces). A GPU user with their own checkout does not need it.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .gpu_a/tok ] && export LAMINA_TEST_TOKENIZER=$PWD/.gpu_a/tok
mkdir -p /root/lamina_assets
[ -f .gpu_a/part_aa ] && cp .gpu_a/part_aa /root/lamina_assets/
if [ -f /root/lamina_assets/part_aa ] && [ -f .gpu_b/part_ab ]; then
  cat /root/lamina_assets/part_aa .gpu_b/part_ab > /tmp/smollm2.gguf && export LAMINA_SMOLLM2_GGUF=/tmp/smollm2.gguf
fi
