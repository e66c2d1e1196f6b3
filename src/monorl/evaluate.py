"""`monorl generate`: completions of prompts from exactly the model the config names."""

from __future__ import annotations

import json
import sys

from jsonargparse import ArgumentParser, Namespace

from monorl.config import RunConfig


def generate_args(p: ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0: greedy (default: rollout.temperature)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")


def cmd_generate(cfg: RunConfig, args: Namespace) -> int:
    from monorl.compile import CompileConfig
    from monorl.generate.engine import Generator
    from monorl.generate.sampling import SamplingParams
    from monorl.model.tokenizer import eos_ids
    from monorl.rl.loop import load_policy, resolve_device

    device = resolve_device(cfg.device)
    model, tok, source = load_policy(cfg, device)
    print(f"model: {source}", file=sys.stderr)
    # the generator builds its own copy (bf16 on CUDA); one call is not worth a compile: eager, decode graphs as set
    gen = Generator(model, cfg.generator, tokenizer=tok, eos_token_ids=eos_ids(tok, model.config),
                    compile=CompileConfig(decode_cuda_graphs=cfg.compile.decode_cuda_graphs))
    del model
    prompts = args.prompt or ["What is the total digit sum of [3, 4]?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": t}]) if args.chat else t for t in prompts]
    r = cfg.rollout
    temperature = r.temperature if args.temperature is None else args.temperature
    sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                        seed=cfg.seed)
    outs = gen.generate([tok.encode(t) for t in texts], sp, n=args.n)
    for t, comps in zip(prompts, outs, strict=True):
        for c in comps:
            text = c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
            print(json.dumps({"prompt": t, "completion": text, "tokens": len(c.token_ids),
                              "finish_reason": c.finish_reason}))
    return 0
