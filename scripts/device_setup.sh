#!/usr/bin/env bash
# On the GPU machine (repository root), after scripts/device_wheels.sh ran here and its outputs were carried:
# installs .device/wheels into .device/site (kept between calls, as ignored paths are) and joins .device/parts/a + b
# into .device/model/<the GGUF's name> once both halves have arrived (checked against .device/gguf.sha256).
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
name=$(awk '{print $2}' .device/gguf.sha256)
if [ ! -f ".device/model/$name" ]; then
  if [ -f .device/parts/a ] && [ -f .device/parts/b ]; then
    mkdir -p .device/model
    cat .device/parts/a .device/parts/b > ".device/model/$name"
    (cd .device/model && sha256sum -c ../gguf.sha256) || { rm -f ".device/model/$name"; exit 1; }
  else
    echo "device_setup.sh: waiting for the GGUF's other half (have: $(ls .device/parts 2>/dev/null | xargs))"
  fi
fi
export PYTHONPATH=$PWD/src:$PWD/.device/site
python3 -c "import torch, transformers, trl, datasets, gguf, jsonargparse; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'gguf ok')"
ls -la .device/model 2>/dev/null || true
echo "export PYTHONPATH=$PYTHONPATH"
