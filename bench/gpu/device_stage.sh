#!/usr/bin/env bash
# Device call 2 (bench/gpu/README.md), carrying .gpu/g1, right after device_check.sh: keeps the
# GGUF's first half on the machine for device_run.sh, which must follow while it is still warm.
set -euo pipefail
[ -d /tmp/gpu/site ] || { echo "no /tmp/gpu/site: run device_check.sh just before"; exit 2; }
cp .gpu/g1/gguf.1 /tmp/gpu/
ls -la /tmp/gpu
