"""Images a tool returns, inside agentic episodes (#59): on a tiny random Qwen3-VL (CPU, fp32), a tool that runs in
a child process writes a PNG and returns it as TRL's content parts (``[{"type": "text"}, {"type": "image", "image":
path}]``); the episode runner inserts its placeholder expanded to the image's tokens, the next turn's prefill runs
the tower on it over the cached conversation, and the rollout carries the prompt's and the tools' images. Each
sampled token's generator log-prob equals the trainer's (within 1e-5; bitwise batch-invariant), and each turn after
a tool image equals the turn sampled from a prefill of the whole conversation before it, images and all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from monorl.agent.calls import ToolCall
from monorl.agent.env import EpisodeEnv, TurnResult
from monorl.agent.task import AgentTask
from monorl.agent.tools import ToolSet
from monorl.generate import Generator, GeneratorConfig, SamplingParams
from monorl.generate.engine import Engine
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.config import ModelConfig
from monorl.model.decoder import build_model
from monorl.rl.rollouts.episodes import EpisodeRunner, generate_episodes
from monorl.tasks.base import Prompt, messages_of
from monorl.tasks.images import PLACEHOLDER
from tests.conftest import randomize_hf_model

pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

from tests.test_qwen3_vl import PROCESSOR, tiny_hf_config  # noqa: E402
from tests.test_vl_rollouts import trainer_logprobs  # noqa: E402

# the child process: a rendered crop (a gradient of the asked size) written as a PNG
CHILD = ("import sys; from PIL import Image; h, w = int(sys.argv[2]), int(sys.argv[3]); "
         "Image.frombytes('RGB', (w, h), bytes((7 * i) % 256 for i in range(h * w * 3))).save(sys.argv[1])")


def crop_tool(out_dir: Path):
    calls = []

    def render_crop(height: int, width: int) -> list[dict[str, Any]]:
        """Render a crop of the scene.

        Args:
            height: Its height in pixels.
            width: Its width in pixels.
        """
        path = out_dir / f"crop{len(calls)}.png"
        calls.append(path)
        subprocess.run([sys.executable, "-c", CHILD, str(path), str(height), str(width)], check=True, timeout=60)
        return [{"type": "text", "text": "crop:"}, {"type": "image", "image": str(path)}]

    return render_crop


class CropEnv(EpisodeEnv):
    """Calls the crop tool after every turn (a scripted call: a random model writes no tool calls) until the turn
    limit ends the episode."""

    SIZES = [(20, 12), (9, 30)]

    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        return messages_of(prompt)

    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        if last_turn:
            return TurnResult(done=True)
        h, w = self.SIZES[self.record.turns - 1]
        result = self.toolset.call(ToolCall("render_crop", {"height": h, "width": w}))
        assert result.ok, result.content
        self.record.add_tool_results([result])
        return TurnResult([result.message()])


class CropTask(AgentTask):
    render_tools = False
    reward_components = ("turns",)

    def __init__(self, out_dir: Path, turns: int, prompt_image: bool) -> None:
        self.tool, self.max_turns, self.prompt_image = crop_tool(out_dir), turns, prompt_image

    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        return CropEnv(ToolSet([self.tool]), max_turns=self.max_turns)

    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        return {"turns": float(episode.record.turns)}

    def prompts(self, out_dir: Path) -> list[Prompt]:
        from PIL import Image

        out = []
        for k in range(2):
            meta: dict[str, Any] = {"messages": [{"role": "user", "content": f"Look {k}."}]}
            if self.prompt_image:
                path = out_dir / f"scene{k}.png"
                Image.new("RGB", (16 + 8 * k, 24), (40 * k, 90, 200)).save(path)
                meta = {"messages": [{"role": "user", "content": PLACEHOLDER + f"Look {k}."}], "images": [str(path)]}
            out.append(Prompt(text=f"Look {k}.", answer="", meta=meta))
        return out

    def train_prompts(self, seed: int = 0, start: int = 0):
        raise NotImplementedError

    def val_prompts(self, n: int) -> list[Prompt]:
        return []


def vl_setup(tmp_path: Path, invariant: bool):
    from tokenizers import AddedToken

    from monorl.model.hf_checkpoint import load_tokenizer
    from tests.test_tokenizer import write_tokenizer_dir
    from tests.test_vision_dataset import VISION_SPECIALS

    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok"))
    tok._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIALS])
    hf = tiny_hf_config().to_dict()
    hf["text_config"]["vocab_size"] = max(tok._tok.get_vocab_size(), 160)
    for key, name in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                      ("vision_end_token_id", "<|vision_end|>")):
        hf[key] = tok.token_to_id(name)
    model = build_model(ModelConfig.from_hf(hf), seed=None)
    with torch.no_grad():
        randomize_hf_model(model, seed=4)
    model.eval()
    if invariant:
        make_batch_invariant_(model)
    gen = Generator(model, GeneratorConfig(max_num_seqs=3, max_model_len=512, block_size=4), tokenizer=tok)
    if invariant:  # the generator's copy converted too, as the RL loop does
        make_batch_invariant_(gen.model)
    gen.image_processor = PROCESSOR
    return tok, model, gen


def sampling(vocab: int) -> SamplingParams:
    # frequent stop tokens: a random model's turns end after a few tokens, so the episode reaches its tool turns
    return SamplingParams(max_new_tokens=200, temperature=1.0, seed=3, stop_token_ids=tuple(range(40, vocab, 3)))


@pytest.mark.parametrize("invariant", [False, True], ids=["fp32", "batch-invariant"])
@pytest.mark.parametrize("turns,prompt_image", [(2, True), (3, False)], ids=["prompt+tool", "tool+tool"])
def test_tool_images_through_episodes_and_the_trainer(tmp_path, invariant, turns, prompt_image):
    tok, model, gen = vl_setup(tmp_path, invariant)
    task = CropTask(tmp_path, turns, prompt_image)
    prompts = task.prompts(tmp_path)
    sp = sampling(model.config.vocab_size)
    runner = EpisodeRunner(gen, tok, task, max_len=512)
    try:
        groups, records = generate_episodes(runner, prompts, sp, n=2)
    finally:
        runner.close()
    vision = model.config.vision
    rollouts = [r for g in groups for r in g]
    assert all(rec.turns == turns and rec.error is None for rec in records)
    for r in rollouts:
        im, ids = r.images, r.prompt_ids + r.completion_ids
        assert im is not None and im.grid_thw.shape[0] == turns - 1 + prompt_image
        # the tools' images sit in inserted tokens (mask 0), each placeholder run whole, after sampled ones
        tool_spans = im.spans[int(prompt_image):]
        for a, b in tool_spans:
            assert a > len(r.prompt_ids) and all(t == vision.image_token_id for t in ids[a:b])
            assert not any(r.completion_mask[a - len(r.prompt_ids):b - len(r.prompt_ids)])
        assert sum(t == vision.image_token_id for t in ids[:im.length]) == sum(b - a for a, b in im.spans)
        # the content parts, in order, as text: the placeholder in the messages, expanded in the tokens
        assert any(m["content"] == "crop:" + PLACEHOLDER for m in r.extra["messages"] if m["role"] == "tool")
        assert "crop:<|vision_start|><|image_pad|><|image_pad|>" in r.text
    seqs = [r.train_sequence(group=i) for i, g in enumerate(groups) for r in g]
    for share in (True, False):
        for s, lp in zip(seqs, trainer_logprobs(model, seqs, share), strict=True):
            want = torch.tensor(s.old_logprobs, dtype=torch.float32)
            keep = torch.tensor(s.completion_mask, dtype=torch.bool)  # the sampled tokens
            if invariant:
                assert torch.equal(lp[keep], want[keep])
            else:
                assert (lp[keep] - want[keep]).abs().max().item() <= 1e-5

    # each turn after a tool's image: the turn a fresh prefill of the whole conversation before it samples
    stop_ids = tuple(dict.fromkeys((*sp.stop_token_ids, *runner.renderer.stop_ids())))
    engine = Engine(gen, max_tokens=512)
    checked = 0
    for i, g in enumerate(groups):
        for j, r in enumerate(g):
            ids, mask = r.prompt_ids + r.completion_ids, [0] * len(r.prompt_ids) + r.completion_mask
            for k, (_, b) in enumerate(r.images.spans[int(prompt_image):]):
                start = next(t for t in range(b, len(ids)) if mask[t])  # the next turn's first sampled token
                end = next((t for t in range(start, len(ids)) if not mask[t]), len(ids))
                upto = _layout(r.images, start, int(prompt_image) + k + 1)
                engine.add((i, j), ids[:start], SamplingParams(max_new_tokens=end - start, temperature=1.0, seed=3,
                                                               stop_token_ids=stop_ids), images=upto)
                events = []
                while not events:
                    events = engine.step()
                engine.finish((i, j))
                assert events[0].token_ids == ids[start:end]
                got, want = torch.tensor(events[0].logprobs), torch.tensor(r.logprobs[start - len(r.prompt_ids):
                                                                                     end - len(r.prompt_ids)])
                if invariant:
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
                checked += 1
    assert checked == len(rollouts) * (turns - 1)


def _layout(im, length: int, images: int):
    """`im`'s first `images` images laid out over a sequence's first `length` tokens (a prefix of the episode)."""
    from monorl.model.qwen3_vl import sequence_positions
    from monorl.model.vision_prompt import ImageInputs

    patches = int(im.grid_thw[:images].prod(dim=1).sum())
    positions = sequence_positions(im, max(length, im.length))[:, :length]
    nxt = int(positions[:, -1].max()) + 1
    return ImageInputs(im.pixel_values[:patches], im.grid_thw[:images], positions, nxt, im.spans[:images])


def test_a_text_only_policy_given_a_tool_image_stops_in_one_line(tmp_path):
    from monorl.model.config import model_shape
    from monorl.model.tokenizer import CharTokenizer

    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    gen = Generator(model, GeneratorConfig(max_num_seqs=2, max_model_len=128, block_size=4))
    task = CropTask(tmp_path, 2, prompt_image=False)
    runner = EpisodeRunner(gen, CharTokenizer(), task, max_len=128)
    sp = SamplingParams(max_new_tokens=40, seed=0, stop_token_ids=tuple(range(2, model.config.vocab_size)))
    try:
        with pytest.raises(ValueError, match="a tool or environment returned an image and the policy has no vision "
                                             "tower: use a vision-language model"):
            runner.play(task.prompts(tmp_path)[:1], sp, n=1)
    finally:
        runner.close()


def test_a_reference_solution_with_tool_images_stops_in_one_line(tmp_path):
    from monorl.agent.render import ChatRenderer
    from monorl.model.tokenizer import CharTokenizer
    from monorl.rl.rollouts.episodes import solution_sequence

    task = CropTask(tmp_path, 2, prompt_image=False)
    task.solution_messages = lambda prompt: [
        {"role": "assistant", "content": "look"},
        {"role": "tool", "name": "render_crop", "content": "crop:" + PLACEHOLDER, "images": ["a.png"]},
        {"role": "assistant", "content": "done"}]
    with pytest.raises(ValueError, match="reference solution's tool / environment message holds images"):
        solution_sequence(ChatRenderer(CharTokenizer()), task, task.prompts(tmp_path)[0])


def test_an_episode_past_max_tool_images_stops_in_one_line(tmp_path):
    tok, model, gen = vl_setup(tmp_path, invariant=False)
    task = CropTask(tmp_path, 3, prompt_image=False)  # two tool images an episode
    runner = EpisodeRunner(gen, tok, task, max_len=512, max_tool_images=1)
    try:
        with pytest.raises(ValueError, match=r"returned 2 images, more than rollout.max_tool_images=1 \(what the "
                                             "memory plan counts\\): raise it") as e:
            runner.play(task.prompts(tmp_path)[:1], sampling(model.config.vocab_size), n=1)
    finally:
        runner.close()
    assert "\n" not in str(e.value)
