"""`monorl eval` and `monorl generate`: a model (exactly `--model.path`: a directory, a run's checkpoint, or a
Hub name) on a task's held-out prompts or on given ones. When the path is a checkpoint of a monorl run, that
run's config.json is the base config (its task, prompt format and generator settings), as for `--resume`."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace

from monorl.cliargs import base_config, flag_value
from monorl.config import RunConfig, config_from_dict
from monorl.distributed.world import World, close_world, init_world, quiet_unless_main
from monorl.model.hub import run_final_checkpoint
from monorl.rl.rollouts.passk import mean_at_k, mean_pass_at_k, pass_component_of, passes


def run_of_checkpoint(path: str) -> Path | None:
    """The monorl run directory `path` names (the run itself, or RUN/checkpoints/NAME with RUN/config.json beside),
    or None."""
    ckpt = Path(run_final_checkpoint(path) or path).expanduser()
    run = ckpt.resolve().parent.parent
    return run if ckpt.parent.name == "checkpoints" and (run / "config.json").is_file() else None


def checkpoint_base(argv: list[str]) -> RunConfig:
    """The base config of eval / generate: the training run's config when --model.path is one of its checkpoints
    (RUN/checkpoints/NAME, RUN/config.json beside) and no --preset / --config is given, else the preset's."""
    path = flag_value(argv, "--model.path")
    explicit = any(a.split("=", 1)[0] in ("--preset", "--config") for a in argv)
    if path is None or explicit:
        return base_config(argv)
    run = run_of_checkpoint(path)
    if run is None:
        return base_config(argv)
    path = str(run_final_checkpoint(path) or path)  # a run directory: its final checkpoint
    run_config = run / "config.json"
    try:
        cfg = config_from_dict(json.loads(run_config.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return base_config(argv)
    from monorl.model.lora import ADAPTER_CONFIG_FILE

    if not (Path(path) / ADAPTER_CONFIG_FILE).is_file():  # an adapter keeps the run's base (random or not)
        cfg.model.random_init = False  # the checkpoint's weights, whatever the run started from
    print(f"config: {run_config} (the run this checkpoint belongs to)", file=sys.stderr)
    return cfg


def load_eval_policy(cfg: RunConfig, device: Any) -> tuple[Any, Any, str]:
    """(model, tokenizer, where the weights came from): `load_policy`'s, or for a LoRA adapter directory (PEFT's
    format: a LoRA run's checkpoints/final) its base with the adapter merged in (fp32). The base is the adapter's
    base_model_name_or_path; a run that started from random weights (no path) gets the same ones from its config."""
    from monorl.model.decoder import DecoderForCausalLM
    from monorl.model.lora import (
        ADAPTER_CONFIG_FILE,
        apply_lora_,
        load_adapter_,
        load_adapter_config,
        merged_state_dict,
    )
    from monorl.model.source import load_policy

    path = cfg.model.path = str(run_final_checkpoint(cfg.model.path) or cfg.model.path) if cfg.model.path else None
    if not path or not (Path(path) / ADAPTER_CONFIG_FILE).is_file():
        return load_policy(cfg.model, device)
    adapter = load_adapter_config(path)  # what monorl cannot run is refused before the base is read
    base = copy.deepcopy(cfg)
    base.model.path = json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8")).get(
        "base_model_name_or_path")
    model, tok, source = load_policy(base.model, device)
    apply_lora_(model, adapter)
    load_adapter_(model, path)
    with torch.device("meta"):
        plain = DecoderForCausalLM(model.config)
    plain.load_state_dict(merged_state_dict(model, torch.float32), strict=True, assign=True)
    return plain, tok, f"{source} + the LoRA adapter {path} (merged)"


@dataclass
class LoadedGenerator:
    """What `generate` and `eval` run: the generator, the tokenizer and the task, where the weights came from, and
    the ranks (one process, or one tensor-parallel group under torchrun; rank 0 prints and writes)."""

    generator: Any
    tokenizer: Any
    task: Any
    source: str
    world: World


@contextlib.contextmanager
def open_generator(cfg: RunConfig) -> Iterator[LoadedGenerator]:
    """`cfg`'s model and task, its generator built as a training run builds its own (`monorl.generate.build`): with
    `generator.tensor_parallel_size` N, under `torchrun --nproc_per_node N`, the N ranks form the group that holds
    one copy between them and make the same calls; batch_invariant (auto resolved for the device, as a run does)
    converts the copy. The ranks' process group ends with the block."""
    from monorl.assembly import resolve_batch_invariant_, resolve_device
    from monorl.compile import CompileConfig
    from monorl.generate.build import build_generator, generator_group
    from monorl.model.source import image_processor
    from monorl.task_registry import load_task

    world = init_world(cfg.device, cfg.distributed.timeout_s, cfg.distributed.backend)
    gen = None
    try:
        tp = cfg.generator.tensor_parallel_size
        if world.size != tp:
            raise ValueError(f"generator.tensor_parallel_size={tp} with {world.size} process(es): generate and eval "
                             f"run one tensor-parallel group, as torchrun --nproc_per_node {tp}")
        quiet_unless_main(world)
        task = load_task(cfg.task.name, **cfg.task.args)
        device = resolve_device(cfg.device, world)
        model, tok, source = load_eval_policy(cfg, device)
        if (why := resolve_batch_invariant_(cfg, device, model.config)) and world.is_main:
            print(why, file=sys.stderr)
        if world.is_main:
            print(f"model: {source}", file=sys.stderr)
        # one call is not worth a compile: eager, decode graphs as set
        gen = build_generator(model, cfg, tok, generator_group(cfg, world),
                              CompileConfig(decode_cuda_graphs=cfg.compile.decode_cuda_graphs))
        gen.image_processor = image_processor(cfg.model, model.config)
        yield LoadedGenerator(gen, tok, task, source, world)
    finally:
        if gen is not None and world.size > 1:  # NCCL kernels in decode graphs: dropped before the group
            gen.release_graphs()
        close_world(world)


def _sampling(cfg: RunConfig, temperature: float, n_tokens: int | None = None):
    from monorl.rl.rollouts.sampling import sampling_params

    return sampling_params(cfg, temperature=temperature,
                           max_new_tokens=n_tokens or cfg.validation.max_new_tokens or cfg.rollout.max_new_tokens)


# ---- generate ----------------------------------------------------------------------------------------------

def generate_args(p: ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for several); default: the task's first --num_prompts held-out prompts")
    p.add_argument("--num_prompts", type=int, default=1, help="held-out prompts to use when no --prompt is given")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0: greedy (default: rollout.temperature)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt text as is (default: render it as the task does: chat template, or the "
                        "plain User:/Assistant: format for tokenizers without one)")
    p.add_argument("--logprobs", action="store_true",
                   help="add each completion's token ids and their log-probs (the generator's, as a run records "
                        "them) to its line")


def cmd_generate(cfg: RunConfig, args: Namespace) -> int:
    """One JSON line per completion; held-out prompts (no --prompt) are scored by the task's reward too."""
    from monorl.tasks.base import Prompt, safe_score_batch

    temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    with open_generator(cfg) as loaded:
        gen, tok, task = loaded.generator, loaded.tokenizer, loaded.task
        given = args.prompt is not None
        prompts = [Prompt(t, None) for t in args.prompt] if given else task.val_prompts(args.num_prompts)
        texts = [p.text if args.raw else task.render(p, tok) for p in prompts]
        outs = gen.generate([tok.encode(t) for t in texts], _sampling(cfg, temperature, cfg.rollout.max_new_tokens),
                            n=args.n)
    if not loaded.world.is_main:
        return 0
    rows = []
    for p, comps in zip(prompts, outs, strict=True):
        for c in comps:
            text = c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
            rows.append((p, text, c))
    scores = [] if given else safe_score_batch(task, [p for p, _, _ in rows], [t for _, t, _ in rows],
                                               [list(c.token_ids) for _, _, c in rows])
    for i, (p, text, c) in enumerate(rows):
        row: dict[str, Any] = {"prompt": p.text, "completion": text, "tokens": len(c.token_ids),
                               "finish_reason": c.finish_reason}
        if scores:  # a held-out prompt has an answer
            row |= {"answer": p.answer, "rewards": scores[i][0]}
        if args.logprobs:
            row |= {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs)}
        print(json.dumps(row, default=str))
    return 0


# ---- eval --------------------------------------------------------------------------------------------------

def eval_args(p: ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=4, help="sampled completions per prompt for pass@k and mean@k "
                                                     "(at rollout.temperature / top_p / top_k; a completion passes "
                                                     "as validation.pass_component / pass_threshold say); 0: greedy "
                                                     "only")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the JSON results go (replaced if it exists); default: eval.json in the run directory "
                        "when --model.path is a run or one of its checkpoints, else in the current directory "
                        "(eval-2.json, ... when taken)")


def _stats(groups: list, component: str, threshold: float) -> dict[str, Any]:
    flat = [r for g in groups for r in g]
    n = max(1, len(flat))
    comps = {c: sum(r.rewards.get(c, 0.0) for r in flat) / n for c in (flat[0].rewards if flat else {})}
    return {"mean_reward": sum(r.reward for r in flat) / n, "components": comps,
            "mean_length": sum(len(r.completion_ids) for r in flat) / n,
            "truncated_frac": sum(r.finish_reason == "length" for r in flat) / n,
            "passed": [[passes(r.rewards, component, threshold) for r in g] for g in groups]}


def evaluate(cfg: RunConfig, k: int, loaded: LoadedGenerator) -> dict[str, Any]:
    """Greedy, and with k > 0 also k sampled completions per prompt, on the task's first validation.num_prompts
    held-out prompts: mean reward and components, pass@1 / pass@k, mean@k (rl.rollouts.passk), lengths. Every rank
    of `loaded`'s tensor-parallel group computes the same results."""
    from monorl.agent.task import AgentTask
    from monorl.rl.rollouts.episodes import EpisodeRunner, generate_episodes
    from monorl.rl.rollouts.rollout import generate_rollouts

    gen, tok, task, source = loaded.generator, loaded.tokenizer, loaded.task, loaded.source
    if isinstance(task, AgentTask):  # an agent task's prompts are played as episodes, as validation plays them
        runner = EpisodeRunner(gen, tok, task, gen.max_model_len)

        def play(prompts: list, sampling: Any, n: int) -> list:
            return generate_episodes(runner, prompts, sampling, n, world=loaded.world)[0]
    else:
        def play(prompts: list, sampling: Any, n: int) -> list:
            return generate_rollouts(gen, tok, task, prompts, sampling, n, gen.max_model_len, world=loaded.world)
    component = pass_component_of(task.reward_components, cfg.validation.pass_component)
    threshold = cfg.validation.pass_threshold
    prompts = task.val_prompts(cfg.validation.num_prompts)
    if not prompts:
        raise ValueError(f"task {task.name!r} has no held-out prompts (validation.num_prompts="
                         f"{cfg.validation.num_prompts})")
    out: dict[str, Any] = {"model": source, "model_path": cfg.model.path, "task": task.name,
                           "num_prompts": len(prompts), "pass_component": component, "pass_threshold": threshold}
    greedy_groups = play(prompts, _sampling(cfg, 0.0), 1)
    greedy = _stats(greedy_groups, component, threshold)
    passed = greedy.pop("passed")
    out["greedy"] = {**greedy, "pass@1": mean_pass_at_k(passed, 1)}
    per_prompt = [{"prompt": g[0].prompt.text, "answer": g[0].prompt.answer, "greedy": g[0].text,
                   "greedy_rewards": g[0].rewards} for g in greedy_groups]
    if k > 0:
        r = cfg.rollout
        groups = play(prompts, _sampling(cfg, r.temperature), k)
        sampled = _stats(groups, component, threshold)
        passed = sampled.pop("passed")
        out["sampled"] = {"k": k, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, **sampled,
                          "pass@1": mean_pass_at_k(passed, 1), f"pass@{k}": mean_pass_at_k(passed, k),
                          f"mean@{k}": mean_at_k([[float(x) for x in p] for p in passed])}
        by_text = {g[0].prompt.text: (g, p) for g, p in zip(groups, passed, strict=True)}
        for row in per_prompt:
            if row["prompt"] in by_text:
                g, p = by_text[row["prompt"]]
                row |= {"sampled_passed": sum(p), "sampled_rewards": [x.reward for x in g]}
    out["prompts"] = per_prompt
    return out


def eval_table(res: dict[str, Any]) -> str:
    comps = list(res["greedy"]["components"])
    head = f"{'':<22}{'mean_reward':>12}{'pass@1':>9}"
    rows = [("greedy", res["greedy"], None)]
    if "sampled" in res:
        s = res["sampled"]
        k = s["k"]
        head += f"{f'pass@{k}':>9}{f'mean@{k}':>9}"
        rows.append((f"sampled k={k} T={s['temperature']:g}", s, k))
    head += "".join(f"{c:>13}" for c in comps) + f"{'length':>9}{'truncated':>10}"
    lines = [f"{res['model']} | task {res['task']} | {res['num_prompts']} held-out prompts | pass: "
             f"{res['pass_component']} >= {res['pass_threshold']:g}", head]
    for name, s, k in rows:
        line = f"{name:<22}{s['mean_reward']:>+12.3f}{s['pass@1']:>9.3f}"
        if "sampled" in res:
            line += f"{s[f'pass@{k}']:>9.3f}{s[f'mean@{k}']:>9.3f}" if k else f"{'':>9}{'':>9}"
        line += "".join(f"{s['components'][c]:>+13.3f}" for c in comps)
        lines.append(line + f"{s['mean_length']:>9.1f}{s['truncated_frac']:>10.2f}")
    return "\n".join(lines)


def _unused_path(path: Path) -> Path:
    """`path`, or the first of path-2, path-3, ... that does not exist (earlier results are never replaced)."""
    found, n = path, 2
    while found.exists():
        found, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return found


def cmd_eval(cfg: RunConfig, args: Namespace) -> int:
    if args.k < 0:
        raise ValueError(f"--k must be >= 0, got {args.k}")
    run = run_of_checkpoint(cfg.model.path) if cfg.model.path else None  # before the path becomes its final checkpoint
    with open_generator(cfg) as loaded:
        res = evaluate(cfg, args.k, loaded)
    if not loaded.world.is_main:  # rank 0 prints and writes
        return 0
    print(eval_table(res))
    # --out FILE: that file, replaced; else beside the run evaluated, or here
    out = Path(args.out) if args.out else _unused_path((run or Path()) / "eval.json").absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**res, "config": cfg.to_dict()}, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0
