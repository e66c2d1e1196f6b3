"""ATen ops a hybrid's decode step runs per Gated DeltaNet layer, on CPU (a proxy for the GPU's kernel launches in a
decode step: the same Python path runs there, fla's or monorl's kernel in place of the reference rule's few ops).
View ops (no kernel) are counted apart.

  PYTHONPATH=src python benchmarks/count_gdn_decode_ops.py [--shape tiny-hybrid|qwen3_5-0.8b]
  TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/count_gdn_decode_ops.py --in-place
      # the CUDA decode path (`monorl.ops.gated_delta_decode`'s two kernels, interpreted on CPU, counted as ops)
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.model import build_model, model_shape, qwen3_5
from monorl.model.config import ModelConfig
from monorl.model.qwen3_5 import GatedDeltaNet

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=16, rope_theta=10000.0, max_position_embeddings=1024).with_family("qwen3_5_text").replace(
    layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8)


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views = 0
        self.paused = False  # inside a Triton kernel's call (the interpreter's own ops are no launches)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if func.is_view:
            self.views += 1
        else:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return out


def is_decode(ctx) -> bool:
    return (getattr(ctx, "slot_mapping", None) is not None and not hasattr(ctx, "varlen")
            and not hasattr(ctx, "cu_seqlens_q") and getattr(ctx, "cu_seqlens", None) is None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny-hybrid")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--in-place", action="store_true", help="the CUDA decode kernels (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.in_place:
        qwen3_5.in_place_decode = lambda x: True
        for name in ("conv_step", "rule_step"):  # a Triton launch each, which no ATen op counts
            kernel = getattr(qwen3_5, name)

            def counted(*a, _kernel=kernel, _name=name, **kw):
                mode = calls[-1]
                mode.ops[f"triton {_name}"] += 1
                mode.paused = True
                try:
                    return _kernel(*a, **kw)
                finally:
                    mode.paused = False
            setattr(qwen3_5, name, counted)
    cfg = TINY if args.shape == "tiny-hybrid" else model_shape(args.shape)
    model = build_model(cfg, seed=None).init_weights(0, std=0.2)
    gen = Generator(model, GeneratorConfig(max_num_seqs=args.rows, max_model_len=64))
    calls: list[Count] = []

    def pre(mod, inputs):
        if is_decode(inputs[3]):
            mode = Count()
            mode.__enter__()
            calls.append(mode)
            mod._counting = mode

    def post(mod, inputs, output):
        mode = getattr(mod, "_counting", None)
        if mode is not None:
            mode.__exit__(None, None, None)
            mod._counting = None

    for m in gen.model.modules():  # the generator's own copy
        if isinstance(m, GatedDeltaNet):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (9,), generator=g).tolist() for _ in range(args.rows)]
    with torch.inference_mode():
        gen.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0, ignore_eos=True))
    last = calls[-1]
    first = calls[-sum(isinstance(m, GatedDeltaNet) for m in gen.model.modules())]
    print(f"the step's first Gated DeltaNet layer (it finds the rows for all): {sum(first.ops.values())} ATen ops")
    print(f"{len(calls)} decode calls of a Gated DeltaNet layer; the last one ran {sum(last.ops.values())} ATen ops "
          f"(+ {last.views} views):")
    for name, n in last.ops.most_common():
        print(f"  {n:3d} {name}")


if __name__ == "__main__":
    main()
