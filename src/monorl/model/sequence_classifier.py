"""A sequence-classifier reward model: an HF `AutoModelForSequenceClassification` checkpoint of a family monorl has
(`Qwen3ForSequenceClassification`, `LlamaForSequenceClassification`, ...: the decoder's body under `model.*` and a
`score.weight [num_labels, hidden]` head, no LM head), run by monorl's own decoder. The body is the one decoder
definition, loaded by monorl's loader (`load_state_dict`); the head is a Linear on the hidden state of each
sequence's last non-pad token, as transformers picks it (the last position whose id is not config.json's
`pad_token_id`; position 0 when every id is). Sequences are packed end to end (`VarlenContext`), no padding."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from monorl.fsutil import read_json
from monorl.model.attention import VarlenContext, resolve_backend
from monorl.model.config import ModelConfig
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.hf_checkpoint import CONFIG_FILE, CheckpointError, _check_dir, load_state_dict
from monorl.model.hub import resolve_model_path

SCORE_WEIGHT = "score.weight"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


class SequenceClassifier(nn.Module):
    """The decoder's body (no LM head) and the `score` head: `scores(sequences) -> [B, num_labels]` fp32."""

    def __init__(self, body: DecoderForCausalLM, score: nn.Linear, pad_token_id: int | None) -> None:
        super().__init__()
        self.body, self.score, self.pad_token_id = body, score, pad_token_id

    @property
    def num_labels(self) -> int:
        return self.score.out_features

    def last_rows(self, sequences: list[list[int]]) -> list[int]:
        """Each sequence's scored row in the packed layout: its last token whose id is not the pad id."""
        rows, start = [], 0
        for s in sequences:
            keep = [i for i, t in enumerate(s) if t != self.pad_token_id]
            rows.append(start + (keep[-1] if keep else 0))
            start += len(s)
        return rows

    @torch.no_grad()
    def scores(self, sequences: list[list[int]], max_tokens: int = 8192) -> Tensor:
        """The head's logits at each sequence's last non-pad token, [B, num_labels] fp32, packed in runs of at most
        `max_tokens` tokens (a longer sequence alone)."""
        device = self.score.weight.device
        backend = resolve_backend("auto", device, self.score.weight.dtype)
        out: list[Tensor] = []
        run: list[list[int]] = []
        for i, s in enumerate(sequences):
            if not s:
                raise ValueError(f"sequence {i} is empty: a reward model scores at least one token")
            if run and sum(map(len, run)) + len(s) > max_tokens:
                out.append(self._pack_scores(run, device, backend))
                run = []
            run.append(s)
        if run:
            out.append(self._pack_scores(run, device, backend))
        return torch.cat(out) if out else torch.zeros(0, self.num_labels)

    def _pack_scores(self, run: list[list[int]], device: torch.device, backend: str) -> Tensor:
        ids = torch.tensor([t for s in run for t in s], dtype=torch.long, device=device)
        ctx = VarlenContext.from_lengths([len(s) for s in run], device, backend)
        hidden = self.body(ids, ctx.positions, ctx)
        rows = torch.tensor(self.last_rows(run), dtype=torch.long, device=device)
        return self.score(hidden[rows]).float()


def load_sequence_classifier(path: str | os.PathLike, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.float32) -> SequenceClassifier:
    """A sequence-classifier checkpoint (a local directory or a Hub name) as a `SequenceClassifier`, frozen, in
    `dtype`. Mixture-of-experts bodies are not read here (their experts' per-expert names)."""
    directory = _check_dir(resolve_model_path(str(path))[0])
    body_cfg, hf, num_labels = classifier_config(directory)
    with torch.device("meta"):
        body = DecoderForCausalLM(body_cfg)
        score = nn.Linear(body_cfg.hidden_size, num_labels, bias=False)
    expected = {**body.state_dict(), SCORE_WEIGHT: score.weight}
    state = load_state_dict(directory, expected, device=device, dtype=dtype)
    score.weight = nn.Parameter(state.pop(SCORE_WEIGHT))
    body.load_state_dict(state, strict=True, assign=True)
    model = SequenceClassifier(body, score, hf.get("pad_token_id"))
    return model.eval().requires_grad_(False)


def classifier_config(directory: Path) -> tuple[ModelConfig, dict, int]:
    """(the body's architecture, config.json, the score head's labels) of a sequence-classifier checkpoint
    directory, no weights read (the memory plan sizes a reward model with it). CheckpointError (one line) for another
    kind of checkpoint or a mixture-of-experts body."""
    hf = read_json(directory / CONFIG_FILE, CheckpointError)
    archs = hf.get("architectures") or []
    if not any(a.endswith(CLASSIFIER_SUFFIX) for a in archs):
        raise CheckpointError(f"{directory / CONFIG_FILE}: architectures {archs} is not a *{CLASSIFIER_SUFFIX} "
                              "checkpoint (a reward model's score head)")
    try:  # the body is the family's causal LM's (ModelConfig reads those)
        cfg = ModelConfig.from_hf({**hf, "architectures": [a.replace(CLASSIFIER_SUFFIX, "ForCausalLM") for a in archs]})
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {e}") from None
    if cfg.is_moe:
        raise CheckpointError(f"{directory}: a mixture-of-experts reward model is not supported")
    # the body alone: an untied LM head would be expected in the file, which holds the score head instead
    return dataclasses.replace(cfg, tie_word_embeddings=True), hf, _num_labels(hf, directory)


def _num_labels(hf: dict, directory: Path) -> int:
    """num_labels as transformers reads it: config.json's `num_labels`, else the size of `id2label` (default 2)."""
    n = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if not isinstance(n, int) or n < 1:
        raise CheckpointError(f"{directory / CONFIG_FILE}: num_labels must be a positive integer, got {n!r}")
    return n
