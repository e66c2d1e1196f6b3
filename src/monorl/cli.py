"""`monorl <verb>`: train (GRPO), generate, presets."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from monorl.config import PRESETS, apply_overrides, parse_override_args, preset

USAGE = """monorl train [--preset NAME] [--key.sub value ...]    run GRPO (default preset: tiny)
monorl train --resume RUN_DIR [--allow-config-change] [--key.sub value ...]
                                                        continue from RUN_DIR's latest checkpoint (or a
                                                        checkpoint dir); overrides apply to its config.json
monorl report RUN_DIR [--out FILE.png]                  plot curves (default RUN_DIR/report.png) + summary
monorl generate [--preset NAME] [--prompt TEXT] [--n N] [--key.sub value ...]
monorl plan [--preset NAME] [--key.sub value ...] [--gpu_memory_gb N]
                                                        memory plan of a run on one GPU of N GB (default:
                                                        this machine's GPU); exit 1 if it does not fit
monorl parity [--preset NAME] [--prompts N] [--samples N] [--tolerance X] [--key.sub value ...]
                                                        generator vs trainer log-probs on a few prompts:
                                                        PASS (exit 0) when max |delta| <= X (default 0:
                                                        bitwise), else FAIL (exit 1)
monorl presets                                          list presets
monorl config [--preset NAME] [--key.sub value ...]     print the resolved config"""


def _resolve(argv: list[str]):
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--preset", default="tiny")
    known, rest = p.parse_known_args(argv)
    cfg = preset(known.preset)
    return apply_overrides(cfg, parse_override_args(rest))


def _resume_config(resume: str, rest: list[str], allow_change: bool):
    """The config to resume with: the run's config.json + `rest` overrides (or, with --preset, `rest` alone,
    as for a fresh run), checked against config.json: differing keys are an error unless allowed."""
    from monorl.config import config_diff, config_from_dict, format_config_diff
    from monorl.rl.checkpointing import find_checkpoint

    ckpt = find_checkpoint(resume)  # CheckpointError (a ValueError) names what is missing
    run_dir = ckpt.parent.parent
    stored_file = run_dir / "config.json"
    try:
        stored = json.loads(stored_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the resumed run's config {stored_file}: {e}") from None
    # compared as read back (a key the run's monorl did not have yet takes its default: no change)
    stored = config_from_dict(stored).to_dict()
    if any(a == "--preset" or a.startswith("--preset=") for a in rest):
        cfg = _resolve(rest)
    else:
        cfg = apply_overrides(config_from_dict(stored), parse_override_args(rest))
    cfg.run_dir = str(run_dir)
    if diff := config_diff(stored, cfg.to_dict()):
        listing = format_config_diff(diff)
        if not allow_change:
            raise ValueError(f"the config differs from the one {run_dir} was trained with ({stored_file}); "
                             f"keys that differ (stored -> now):\n{listing}\n"
                             "pass --allow-config-change to resume with the new values")
        print(f"resuming with a changed config (--allow-config-change):\n{listing}", file=sys.stderr)
    return cfg


def cmd_train(argv: list[str]) -> int:
    from monorl.rl.loop import train

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--resume", default=None)
    p.add_argument("--allow-config-change", action="store_true")
    known, rest = p.parse_known_args(argv)
    if known.resume is None:
        if known.allow_config_change:
            raise ValueError("--allow-config-change only applies with --resume RUN_DIR")
        cfg = _resolve(rest)
    else:
        cfg = _resume_config(known.resume, rest, known.allow_config_change)
    train(cfg, progress=sys.stderr.isatty(), resume=known.resume)
    return 0


def cmd_report(argv: list[str]) -> int:
    from monorl.rl.report import report

    p = argparse.ArgumentParser(prog="monorl report")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    a = p.parse_args(argv)
    try:
        print(report(a.run_dir, a.out))
    except ImportError as e:  # matplotlib is optional
        print(f"monorl: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_generate(argv: list[str]) -> int:
    from monorl.compile import CompileConfig
    from monorl.generate.engine import Generator
    from monorl.generate.sampling import SamplingParams
    from monorl.model.tokenizer import eos_ids
    from monorl.rl.loop import load_policy, resolve_device

    p = argparse.ArgumentParser(prog="monorl generate", add_help=False)
    p.add_argument("--prompt", action="append", default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    known, rest = p.parse_known_args(argv)
    cfg = _resolve(rest)
    device = resolve_device(cfg.device)
    model, tok, source = load_policy(cfg, device)
    print(f"model: {source}", file=sys.stderr)
    # the generator builds its own copy (bf16 on CUDA); one call is not worth a compile: eager, decode graphs as set
    gen = Generator(model, cfg.generator, tokenizer=tok, eos_token_ids=eos_ids(tok, model.config),
                    compile=CompileConfig(decode_cuda_graphs=cfg.compile.decode_cuda_graphs))
    del model
    prompts = known.prompt or ["What is the total digit sum of [3, 4]?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": t}]) if known.chat else t for t in prompts]
    r = cfg.rollout
    sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        seed=cfg.seed)
    outs = gen.generate([tok.encode(t) for t in texts], sp, n=known.n)
    for t, comps in zip(prompts, outs, strict=True):
        for c in comps:
            text = c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
            print(json.dumps({"prompt": t, "completion": text, "tokens": len(c.token_ids),
                              "finish_reason": c.finish_reason}))
    return 0


def cmd_plan(argv: list[str]) -> int:
    import torch

    from monorl.plan import GiB, plan_report

    p = argparse.ArgumentParser(prog="monorl plan", add_help=False, allow_abbrev=False)
    p.add_argument("--gpu_memory_gb", type=float, default=None)
    known, rest = p.parse_known_args(argv)
    if known.gpu_memory_gb is not None:
        if not known.gpu_memory_gb > 0:
            raise ValueError(f"--gpu_memory_gb must be > 0, got {known.gpu_memory_gb}")
        device_bytes = int(known.gpu_memory_gb * GiB)
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        raise ValueError("no GPU here: give the GPU's memory with --gpu_memory_gb N, in GiB as nvidia-smi's MiB / 1024 "
                         "(79.6 for an H100 80GB, 140.4 for an H200)")
    text, fits = plan_report(_resolve(rest), device_bytes)
    print(text)
    return 0 if fits else 1


def cmd_parity(argv: list[str]) -> int:
    from monorl.parity import run_parity

    p = argparse.ArgumentParser(prog="monorl parity", add_help=False, allow_abbrev=False)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.0)
    known, rest = p.parse_known_args(argv)
    return run_parity(_resolve(rest), known.prompts, known.samples, known.tolerance)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    verb, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("train", argv)
    try:
        if verb == "train":
            return cmd_train(rest)
        if verb == "generate":
            return cmd_generate(rest)
        if verb == "report":
            return cmd_report(rest)
        if verb == "plan":
            return cmd_plan(rest)
        if verb == "parity":
            return cmd_parity(rest)
        if verb == "presets":
            print("\n".join(PRESETS))
            return 0
        if verb == "config":
            print(json.dumps(_resolve(rest).to_dict(), indent=2))
            return 0
        if verb in ("-h", "--help", "help"):
            print(USAGE)
            return 0
        print(f"unknown command {verb!r}\n{USAGE}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:  # configuration / input errors: one clear line, no traceback
        print(f"monorl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: where the run stands (the loop fills this in), no traceback
        print(f"\nmonorl: {e or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
