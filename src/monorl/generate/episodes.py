"""`run_episodes`: drive multi-turn requests (episodes) on the `Engine` to their end, an environment answering each
turn. An episode is a request that pauses at each turn's end holding its cache (`monorl.generate.engine`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

from monorl.generate.engine import Engine
from monorl.generate.requests import ContextOverflowError, Request, TurnEvent
from monorl.generate.sampling import SamplingParams


def run_episodes(engine: Engine, prompts: Mapping[Hashable, list[int]], sampling: SamplingParams,
                 environment: Callable[[Request, TurnEvent], list[int] | None],
                 stop_sequences: Iterable[Iterable[int]] = ()) -> dict[Hashable, Request]:
    """Drive episodes to their end: add every prompt, step; after each turn `environment(episode, event)` returns
    the tokens to append (the episode resumes) or None (it is finished). An append that overflows the episode
    finishes it too (its last_event says why the last turn ended). Returns the finished episodes by id."""
    stop_sequences = [tuple(s) for s in stop_sequences]
    for request_id, prompt in prompts.items():
        engine.add(request_id, prompt, sampling, stop_sequences)
    done: dict[Hashable, Request] = {}
    while len(done) < len(prompts):
        if not engine.has_work():
            raise RuntimeError("episodes are paused with no turn to run (an environment left one unanswered)")
        for ev in engine.step():
            new = environment(engine.request(ev.request_id), ev)
            if new is not None:
                try:
                    engine.resume(ev.request_id, new)
                    continue
                except ContextOverflowError:
                    pass
            done[ev.request_id] = engine.finish(ev.request_id)
    return done
