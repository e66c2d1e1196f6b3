#!/bin/bash
# Next session (after session 25, when no machine was lent for its second call). One fresh machine, Triton 3.6
# (carry .device/wheels .device/tok), in this order:
# 1. W0 once: trainer_init without fla's import (7.24 s warm, 10.70 s fresh in session 25's call).
# 2. The generator copy's gated attention on its kernels (`attention_gate.ENABLED`, off by default until these
#    pass): its own GPU tests (they switch it on), then the hybrid generator's bf16 cases with it on and off, and
#    the decode kernels' test (the rule step at 64 values on 4 warps, swept but not yet checked on a GPU).
# 3. Qwen3.5's fused layer seams (`qwen3_5_fused.ENABLED`, off by default): their GPU tests, and the hybrid
#    generator's bf16 cases with both switches on.
# 4. W0 with the invariant GEMM's K parts against none (w0_parts). Where 2 and 3 pass, set the switches on.
set -u
source scripts/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
w0_runs 1
TLIMIT=200 PTLIMIT=120 tests gpu_tests_gate tests/test_gated_attention_kernel_gpu.py tests/test_qwen3_5_fused_gpu.py
for on in True False; do
  timeout 200 python3 - $on > $OUT/gpu_tests_hybrid_gate_$on.log 2>&1 <<'PY'
import sys
import pytest
from monorl.model import qwen3_5_fused
from monorl.ops import attention_gate
attention_gate.ENABLED = qwen3_5_fused.ENABLED = sys.argv[1] == "True"
sys.exit(pytest.main(["-v", "-p", "no:cacheprovider", "--tb=short", "--timeout", "150", "-m", "gpu",
                      "tests/test_qwen3_5_gpu.py", "-k", "(as_exact and (dtype0 or dtype1)) or decode_kernels"]))
PY
  echo "hybrid generator, gated-attention kernels and fused seams $on: rc $?"
  grep -E "PASSED|FAILED|^E  .*against float64" $OUT/gpu_tests_hybrid_gate_$on.log | cut -c1-200 | head -8
done
w0_parts 1
