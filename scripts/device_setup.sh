#!/usr/bin/env bash
# On the GPU machine (repository root), after scripts/device_wheels.sh ran here and its outputs were carried:
# installs .device/wheels into .device/site (kept between calls, as ignored paths are) and joins .device/parts/a, b,
# ... into .device/model/<the GGUF's name> once every part .device/gguf.sha256 lists has arrived (each part and the
# whole file checked against it). `bash scripts/device_setup.sh SLOT` joins a second file's .device/SLOT/parts
# (device_wheels.sh --slot SLOT) into .device/model/ the same way.
# Source it or prefix commands with `PYTHONPATH=$PWD/src:$PWD/.device/site` (this script prints the line).
set -euo pipefail
cd "$(dirname "$0")/.."
# (re)installed when the carried wheels differ from the ones installed last
if compgen -G ".device/wheels/*.whl" >/dev/null; then
  want=$(ls .device/wheels | sort | sha256sum | cut -c1-16)
  if [ "$(cat .device/site/.installed 2>/dev/null)" != "$want" ]; then
    rm -rf .device/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .device/site \
      .device/wheels/*.whl
    echo "$want" > .device/site/.installed
  fi
fi
[ -f .device/site/.installed ] || { echo "device_setup.sh: no wheels installed yet (carry .device/wheels)" >&2; exit 1; }
slot=${1:-}
dir=.device${slot:+/$slot}
[ -f "$dir/gguf.sha256" ] || { echo "device_setup.sh: no $dir/gguf.sha256 (carry it with the first part)" >&2; exit 1; }
name=$(awk 'NR == 1 {print $2}' "$dir/gguf.sha256")
parts=$(awk 'NR > 1 {print $2}' "$dir/gguf.sha256")
[ -n "$parts" ] || { echo "device_setup.sh: $dir/gguf.sha256 lists no parts (rerun scripts/device_wheels.sh)" >&2; exit 1; }
if [ ! -f ".device/model/$name" ]; then
  missing=$(for p in $parts; do [ -f "$dir/$p" ] || echo "$p"; done)
  if [ -z "$missing" ]; then
    (cd "$dir" && sed 1d gguf.sha256 | sha256sum -c --quiet) || { echo "device_setup.sh: a part of $name is damaged (above)" >&2; exit 1; }
    mkdir -p .device/model
    (cd "$dir" && cat $parts) > ".device/model/$name"
    (cd .device/model && head -1 "../${slot:+$slot/}gguf.sha256" | sha256sum -c) || { rm -f ".device/model/$name"; exit 1; }
  else
    echo "device_setup.sh: $name waits for its part(s)" $missing "(have: $(ls "$dir/parts" 2>/dev/null | xargs))"
  fi
fi
export PYTHONPATH=$PWD/src:$PWD/.device/site
python3 -c "import torch, transformers, trl, datasets, gguf, jsonargparse; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'gguf ok')"
ls -la .device/model 2>/dev/null || true
echo "export PYTHONPATH=$PYTHONPATH"
