"""A reward model as a reward component (`--task.args.reward reward_model --task.args.reward_model PATH`): an HF
sequence-classifier checkpoint (`monorl.model.sequence_classifier`, run by monorl's decoder) scores each prompt +
completion, as TRL's GRPOTrainer scores with a `reward_funcs` entry that is a sequence-classification model. It is a
reward function of TRL's signature like any other: weighted (`reward_weights`), logged as `rewards/reward_model/*`.

The text is tokenized with the reward model's own tokenizer (it need not be the policy's): a conversational prompt
through its chat template with the completion as the assistant's message, as TRL does; a plain prompt as prompt +
completion. The model is loaded at the first call (CUDA in bf16 when available, else CPU in fp32) and scores the
whole batch in packed runs."""

from __future__ import annotations

from typing import Any

import torch

from monorl.tasks.completions import completion_text

MAX_PACK_TOKENS = 16384  # tokens per packed forward of the reward model


class reward_model:  # noqa: N801 -- named as the component it gives (rewards/reward_model/*)
    """A TRL-signature reward function of a sequence-classifier checkpoint; `label`: the head's output scored
    (0: a one-label reward model's score)."""

    def __init__(self, path: str, label: int = 0, device: str | None = None) -> None:
        self.path, self.label = str(path), int(label)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        from monorl.model.hf_checkpoint import load_tokenizer
        from monorl.model.hub import resolve_model_path
        from monorl.model.sequence_classifier import load_sequence_classifier

        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self._model = load_sequence_classifier(self.path, self.device, dtype)
        if not 0 <= self.label < self._model.num_labels:
            raise ValueError(f"reward_model_label {self.label} is not one of the model's {self._model.num_labels} "
                             "labels")
        self._tokenizer = load_tokenizer(resolve_model_path(self.path)[0])

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads: the conversation through its chat template, else prompt + completion."""
        if isinstance(prompt, list):
            messages = [*prompt, {"role": "assistant", "content": completion_text(completion)}]
            return self._tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        return str(prompt) + completion_text(completion)

    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
        if self._model is None:
            self._load()
        seqs = [self._tokenizer.encode(self.text(p, c)) for p, c in zip(prompts, completions, strict=True)]
        scores = self._model.scores(seqs, MAX_PACK_TOKENS)
        return scores[:, self.label].tolist()
