"""A sequence-classifier reward model run by monorl's decoder scores as transformers' `*ForSequenceClassification`
does (a tiny random config saved with `save_pretrained`, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from monorl.model.sequence_classifier import load_sequence_classifier  # noqa: E402

PAD = 0
SEQS = [[5, 9, 17, 3, 44], [7, 8], [12, 30, 31, 2, 11, 60, 61, 3, PAD], [PAD, PAD], [50]]


def _save(tmp: Path, family: str, num_labels: int) -> tuple[Path, torch.nn.Module]:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, num_labels=num_labels,
                  tie_word_embeddings=False)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, **common)
        cls = transformers.Qwen3ForSequenceClassification
    else:
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForSequenceClassification
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # the head starts near zero in HF's init: give it scale, so the comparison means something
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp / family)
    return tmp / family, hf


@pytest.mark.parametrize("family,num_labels", [("qwen3", 1), ("llama", 3)])
def test_scores_equal_transformers(tmp_path: Path, family: str, num_labels: int) -> None:
    path, hf = _save(tmp_path, family, num_labels)
    rm = load_sequence_classifier(path)
    assert rm.num_labels == num_labels
    ours = rm.scores(SEQS, max_tokens=12)  # several packs
    with torch.no_grad():
        theirs = torch.cat([hf(input_ids=torch.tensor([s])).logits for s in SEQS])
    assert ours.shape == (len(SEQS), num_labels)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=0)
    # the row scored: a trailing pad is skipped, an all-pad sequence scores its first token (transformers' rule)
    assert rm.last_rows(SEQS) == [4, 6, 14, 16, 18]


def test_the_reward_model_reward_scores_prompt_and_completion_through_the_dataset_task(tmp_path: Path) -> None:
    """`--task.args.reward reward_model,format --task.args.reward_model DIR`: a reward component beside a Python
    one, weighted; its values are transformers' scores of prompt + completion in the reward model's tokenizer."""
    from monorl.model.tokenizer import CharTokenizer
    from monorl.tasks.dataset import DatasetTask

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=PAD,
                                   num_labels=1, max_position_embeddings=128)
    torch.manual_seed(1)
    hf = transformers.Qwen3ForSequenceClassification(cfg).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / "rm")
    CharTokenizer().save(tmp_path / "rm")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+5=", "answer": "7"}\n')
    task = DatasetTask(data, reward="reward_model,format", reward_weights="0.5,1", reward_model=str(tmp_path / "rm"),
                       format_pattern="^[0-9]+$")
    assert task.reward_components == ("reward_model", "format")
    assert task.reward_weights == {"reward_model": 0.5, "format": 1.0}
    fn = task._fns[0].fn
    prompts, completions = ["1+1=", "2+5="], ["2", "seven"]
    got = fn(prompts, completions, [[0], [0]])
    tok = CharTokenizer()
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([tok.encode(p + c)])).logits[0, 0].item()
                for p, c in zip(prompts, completions, strict=True)]
    assert got == pytest.approx(want, abs=1e-4)
