"""Images in dataset rows (TRL's `image` / `images` columns: paths in JSONL, bytes in Parquet, `datasets` Image
features) reach the prompt, its chat rendering holds one vision placeholder per image, and the encoded prompt
expands each to the image's token count, as transformers' Qwen3-VL processor expands <|image_pad|>."""

from __future__ import annotations

import io
import json

import pytest
from tokenizers import AddedToken

from monorl.model.hf_checkpoint import load_tokenizer
from monorl.model.image_processing import IMAGE_PAD, ImageProcessor
from monorl.model.vision_config import VisionConfig
from monorl.model.vision_prompt import encode_with_images
from monorl.tasks.dataset import DatasetTask
from tests.test_tokenizer import write_tokenizer_dir

Image = pytest.importorskip("PIL.Image")
datasets = pytest.importorskip("datasets")

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
PROCESSOR = ImageProcessor(patch_size=4, merge_size=2, min_pixels=64, max_pixels=32 * 32)


def picture(h: int, w: int, colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (w, h), colour)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def tokenizer(tmp_path):
    path = write_tokenizer_dir(tmp_path / "tok")
    tok = load_tokenizer(path)
    tok._tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in VISION_SPECIALS])
    return tok


def vision_for(tok) -> VisionConfig:
    return VisionConfig(depth=1, hidden_size=16, intermediate_size=16, num_heads=1, out_hidden_size=16, patch_size=4,
                        num_position_embeddings=16, image_token_id=tok.token_to_id(IMAGE_PAD),
                        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
                        vision_end_token_id=tok.token_to_id("<|vision_end|>"))


def check_prompt(task: DatasetTask, tokenizer, sizes: list[tuple[int, int]]) -> None:
    prompt = next(task.train_prompts(seed=0))
    assert len(prompt.meta["images"]) == len(sizes)
    text = task.render(prompt, tokenizer)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == len(sizes)
    vision = vision_for(tokenizer)
    ids, inputs = encode_with_images(tokenizer.encode(text), prompt.meta["images"], vision, PROCESSOR)
    grids = [PROCESSOR.grid(h, w) for h, w in sizes]
    assert inputs.grid_thw.tolist() == [list(g) for g in grids]
    # transformers' processor: each <|image_pad|> in the text replaced by the image's count of them, then tokenized
    expanded = text
    for g in grids:
        expanded = expanded.replace(IMAGE_PAD, "<|placeholder|>" * PROCESSOR.token_count(g), 1)
    assert ids == tokenizer.encode(expanded.replace("<|placeholder|>", IMAGE_PAD))
    assert inputs.positions.shape == (3, len(ids))


def test_jsonl_with_relative_paths(tmp_path, tokenizer):
    picture(20, 12, (255, 0, 0)).save(tmp_path / "red.png")
    rows = [{"prompt": "What colour?", "image": "red.png", "answer": "red"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_prompt(DatasetTask(path=tmp_path / "data.jsonl", reward="format"), tokenizer, [(20, 12)])


def test_parquet_with_bytes_and_messages(tmp_path, tokenizer):
    ds = datasets.Dataset.from_list([{
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Same colour?"}],
        "images": [png(picture(16, 16, (0, 0, 255))), png(picture(40, 9, (0, 255, 0)))], "answer": "no"}])
    ds.to_parquet(tmp_path / "data.parquet")
    task = DatasetTask(path=tmp_path / "data.parquet", reward="format")
    check_prompt(task, tokenizer, [(16, 16), (40, 9)])
    messages = next(task.train_prompts(seed=0)).meta["messages"]
    assert messages[1]["content"].startswith("<|vision_start|>") and messages[0]["content"] == "Be brief."


def test_datasets_image_feature(tmp_path, tokenizer):
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image(),
                                  "answer": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"prompt": ["Colour?"], "image": [picture(12, 30, (9, 9, 9))],
                                     "answer": ["grey"]}, features=features)
    ds.save_to_disk(str(tmp_path / "saved"))
    check_prompt(DatasetTask(path=tmp_path / "saved", reward="format"), tokenizer, [(12, 30)])


def test_bad_image_value_is_one_line(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "x", "image": 3, "answer": "y"}) + "\n")
    task = DatasetTask(path=tmp_path / "data.jsonl", reward="format")
    with pytest.raises(ValueError, match="row 0: an image must be a PIL image, a path or bytes, got int"):
        next(task.train_prompts(seed=0))


def test_placeholders_must_match_images(tokenizer):
    vision = vision_for(tokenizer)
    with pytest.raises(ValueError, match="1 image placeholder"):
        encode_with_images(tokenizer.encode("<|image_pad|>"), [picture(8, 8, (1, 2, 3))] * 2, vision, PROCESSOR)


def test_rollouts_refuse_prompts_with_images_only_where_not_fed(tmp_path, tokenizer):
    """encode_prompts keeps a prompt with images where its caller feeds them (`images=True`: the colocated
    rollouts, which expand them in `generate_rollouts`); elsewhere it stops in one line."""
    from monorl.rl.rollouts.rollout import encode_prompts

    picture(8, 8, (1, 2, 3)).save(tmp_path / "a.png")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "x", "image": "a.png", "answer": "y"}) + "\n")
    task = DatasetTask(path=tmp_path / "data.jsonl", reward="format")
    prompt = next(task.train_prompts(seed=0))
    with pytest.raises(ValueError, match="this rollout path does not feed images to the model yet"):
        encode_prompts(task, tokenizer, [prompt], max_len=512, max_new_tokens=8)
    kept, ids = encode_prompts(task, tokenizer, [prompt], max_len=512, max_new_tokens=8, images=True)
    assert kept == [prompt] and ids[0].count(tokenizer.token_to_id("<|image_pad|>")) == 1
