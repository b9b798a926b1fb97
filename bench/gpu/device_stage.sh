#!/usr/bin/env bash
# The first device call (bench/gpu/README.md): keeps the wheels, the dist-info and the first half
# of the GGUF on the machine for the second call, which must follow while it is still warm.
set -euo pipefail
mkdir -p /tmp/gpu
cp -r .gpu/a/. /tmp/gpu/
ls -la /tmp/gpu
