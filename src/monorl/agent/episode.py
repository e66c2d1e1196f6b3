"""One episode, token in / token out: the reference of what the engine's episode runner does, one episode at a time.

`Trajectory` is what training reads: the prompt's tokens, then the completion's tokens (every turn the model
sampled and every span the runner inserted), with `mask` 1 on sampled tokens (they carry log-probs and train)
and 0 on inserted ones (tool results, environment messages, turn headers: never trained). The model's text is
decoded only to give the environment something to read; its tokens are kept as sampled.

`play_episode(task, prompt, renderer, sample_turn, max_new_tokens)` runs the loop with `sample_turn(context_ids)
-> sampled ids` (a turn, ending with the end-of-turn token or not). The completion budget counts inserted tokens
too (TRL's ``max_completion_length`` does): when a turn or an insertion would pass it, the episode ends
(truncation "length"; an insertion that does not fit is left out, as TRL drops tool results that overflow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from monorl.agent.env import EpisodeEnv
from monorl.agent.render import ChatRenderer
from monorl.agent.task import AgentTask
from monorl.tasks.base import Prompt


@dataclass
class Trajectory:
    """An episode's tokens: `prompt_ids`, then `completion_ids` with `mask` (1 sampled, 0 inserted)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def add_sampled(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.mask += [1] * len(ids)

    def add_inserted(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.mask += [0] * len(ids)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def play_episode(task: AgentTask, prompt: Prompt, renderer: ChatRenderer,
                 sample_turn: Callable[[list[int]], list[int]], max_new_tokens: int) -> tuple[Trajectory, EpisodeEnv]:
    """Play one episode of `task` on `prompt` (see the module docstring); the environment is finished (its
    reward read) and returned with the trajectory, ready for `safe_score_episode`."""
    tok = renderer.tokenizer
    env = task.make_env(prompt)
    first = env.start(prompt)
    tools = task.tool_schemas(env)
    traj = Trajectory(tok.encode(renderer.render(first.messages, tools=tools)) if not first.done else [])
    while not env.done:
        budget = max_new_tokens - len(traj.completion_ids)
        sampled = list(sample_turn(traj.ids))[:budget]
        traj.add_sampled(sampled)
        closed = renderer.closes_turn(sampled)
        eot = len(tok.encode(renderer.end_of_turn)) if closed else 0
        if not closed and len(traj.completion_ids) >= max_new_tokens:
            env.truncate("length")  # cut mid-turn: nothing to answer
            break
        turn = env.respond(tok.decode(sampled[: len(sampled) - eot]))
        if turn.done:
            break
        inserted = renderer.delta_ids(turn.messages, tools=tools, closed=closed)
        if len(traj.completion_ids) + len(inserted) >= max_new_tokens:
            env.truncate("length")  # no room for the answer and another turn
            break
        traj.add_inserted(inserted)
    env.finish()
    return traj, env
