"""A generative judge as a reward component (`--task.args.reward judge --task.args.judge_model PATH`): a second model
reads a prompt made of the question, the completion and a rubric, answers with a grade, and the grade parsed from its
answer ("Score: 7/10" -> 0.7) is the reward. An answer with no grade is a parse failure: the reward is None for that
completion (no component applies: advantage 0 and out of its group's statistics, TRL's rule) and it is counted.

The judge generates on a second engine instance, built by the one generator builder (`monorl.generate.build.
build_generator`) from a model loaded by the policy's loader (any checkpoint kind `model.path` takes; pass the
policy's own path to judge with the policy as it was at step 0), with its own sampling settings (greedy and 16
tokens by default). The step's completions are judged in one batch. Metrics, by TRL's `log_metric` (averaged over
a step's calls): `judge/calls` (completions judged), `judge/parse_failures` (answers with no grade).

Reference-guided judging (MT-Bench's grading of math against a reference answer, Zheng et al. 2023): a template
holding `{reference}` shows the judge each prompt's known answer, from the data's `solution` column, else its
`answer` column (the columns the `accuracy` reward reads); a small judge can then compare instead of solve."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from monorl.tasks.completions import completion_text
from monorl.tasks.reward_context import RewardFunctionError

log = logging.getLogger("monorl")

DEFAULT_TEMPLATE = ("Grade the answer to the question by the rubric, from 0 to 10.\n"
                    "Question: {question}\nAnswer: {completion}\nRubric: {rubric}\nScore:")
DEFAULT_RUBRIC = "correct, complete and concise"
# "Score: 7/10", "score: 7.5 / 10"; a template ending in "Score:" has the judge's answer read after it
SCORE_RE = re.compile(r"score:\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
SCORE_PREFIX = "Score:"


def parse_score(text: str) -> float | None:
    """The first "Score: N/M" of `text` as N / M (0 <= N <= M, M > 0), else None."""
    m = SCORE_RE.search(text)
    if m is None:
        return None
    n, d = float(m.group(1)), float(m.group(2))
    return n / d if d > 0 and n <= d else None


def check_template(template: Any) -> None:
    """ValueError (one line) for a template the judge cannot read as meant: not text, without {question} or
    {completion}, or carrying a command line's quoting (a shell keeps `\\n` as two characters)."""
    if not isinstance(template, str):
        raise ValueError(f"judge_template must be text, got {type(template).__name__} {template!r} (the command "
                         "line reads 'a: {b}' as a YAML mapping: quote it, --task.args.judge_template '\"...\"')")
    for key in ("{question}", "{completion}"):
        if key not in template:
            raise ValueError(f"judge_template must contain {key}, got {template!r}")
    if "\\n" in template and "\n" not in template:
        raise ValueError("judge_template holds '\\n' (two characters) and no line break: pass it as a YAML "
                         "double-quoted string, --task.args.judge_template '\"Q: {question}\\nScore:\"', or "
                         "with real line breaks (a --config file)")


def as_asked(tokenizer: Any, text: str, chat: bool = True) -> str:
    """The text a judge continues: `text` as one user turn through the tokenizer's chat template (`chat`, a
    tokenizer with one), else `text` itself."""
    if chat and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return text


@dataclass
class _JudgeSections:  # what `build_generator` reads of a run config (`GeneratorSections`): the judge's own
    generator: Any
    lora: Any
    batch_invariant: bool = False


def _prompt_text(prompt: Any) -> str:
    """A prompt as the judge reads it: a string, or a conversation's last user message."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt)


class judge:  # noqa: N801 -- named as the component it gives (rewards/judge/*)
    """A TRL-signature reward function: the judge model's grade of each completion (see the module docstring)."""

    def __init__(self, path: str, rubric: str = DEFAULT_RUBRIC, template: str = DEFAULT_TEMPLATE,
                 max_new_tokens: int = 16, temperature: float = 0.0, chat: bool = True,
                 device: str | None = None) -> None:
        check_template(template)
        self.chat = bool(chat)
        self.path, self.rubric, self.template = str(path), rubric, template
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.generator: Any = None
        self.tokenizer: Any = None
        # its engine's slots, context and KV cache: a run's are the memory plan's (`monorl.plan_rewards.judge_engine`);
        # None: `GeneratorConfig`'s defaults
        self.engine: Any = None
        self.warned = False  # parse failures are warned about once

    def _load(self) -> None:
        from monorl.compile import CompileConfig
        from monorl.generate.build import build_generator
        from monorl.generate.generator import GeneratorConfig
        from monorl.generate.tensor_parallel import tensor_parallel_group
        from monorl.model.lora import LoRAConfig
        from monorl.model.section import ModelSection
        from monorl.model.source import load_policy

        model, self.tokenizer, _ = load_policy(ModelSection(path=self.path), self.device,
                                               dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model.requires_grad_(False)
        sections = _JudgeSections(self.engine or GeneratorConfig(), LoRAConfig())
        self.generator = build_generator(model, sections, self.tokenizer, tensor_parallel_group(0, 1, 1),
                                         CompileConfig(), allocate_kv=True)

    def prompt(self, question: Any, completion: Any, reference: Any = None) -> str:
        return self.template.format(question=_prompt_text(question), completion=completion_text(completion),
                                    rubric=self.rubric, reference="" if reference is None else reference)

    def render(self, text: str) -> str:
        return as_asked(self.tokenizer, text, self.chat)

    def references(self, columns: dict[str, Any], size: int) -> list[Any]:
        """Each completion's reference answer for a `{reference}` template (None each without one)."""
        if "{reference}" not in self.template:
            return [None] * size
        gold = columns.get("solution", columns.get("answer"))
        if gold is None:
            raise RewardFunctionError("judge_template holds {reference}, filled from a 'solution' or 'answer' "
                                      f"column; the data has {sorted(columns) or 'no other columns'}")
        return list(gold)

    def grade(self, answers: list[str]) -> tuple[list[float | None], int]:
        """The judge's answers -> (rewards, parse failures); the template's closing "Score:" is read before each."""
        lead = SCORE_PREFIX if self.template.rstrip().endswith(SCORE_PREFIX) else ""
        scores = [parse_score(lead + a) for a in answers]
        return scores, sum(s is None for s in scores)

    def __call__(self, prompts: list, completions: list, completion_ids: list, log_metric: Any = None,
                 **columns: Any) -> list[float | None]:
        from monorl.generate.sampling import SamplingParams

        if self.generator is None:
            self._load()
        refs = self.references(columns, len(completions))
        ids = [self.tokenizer.encode(self.render(self.prompt(p, c, r)))
               for p, c, r in zip(prompts, completions, refs, strict=True)]
        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)
        outs = self.generator.generate(ids, sampling, n=1)  # the whole batch on one engine
        answers = [o[0].text or "" for o in outs]
        scores, failures = self.grade(answers)
        if failures and not self.warned:  # once: judge/parse_failures counts them every step
            self.warned = True
            first = next(a for a, s in zip(answers, scores, strict=True) if s is None)
            log.warning("judge: %d of %d answers hold no grade ('Score: N/M'; the first: %r, after a template ending "
                        "%r): those completions are unscorable (advantage 0); the metric judge/parse_failures "
                        "counts them each step", failures, len(answers), first[:80], self.template[-40:])
        if log_metric is not None:
            log_metric("judge/calls", float(len(scores)))
            log_metric("judge/parse_failures", float(failures))
        return scores
