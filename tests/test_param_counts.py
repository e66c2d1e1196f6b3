"""The memory plan's parameter counts (`monorl.plan_params.param_counts`) against transformers' own classes of each
family with a layer of its own (built on the meta device: no memory), and split by kind as the plan reads them."""

from __future__ import annotations

import pytest
import torch

from monorl.model.config import model_shape
from monorl.plan_params import param_counts

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("shape", ["qwen3_5-0.8b", "gpt-oss-20b", "gemma3-270m", "qwen3-30b-a3b", "smollm2-135m"])
def test_counts_equal_the_transformers_model(shape: str) -> None:
    m = model_shape(shape)
    config = transformers.AutoConfig.for_model(**m.to_hf())
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(param_counts(m).values()) == sum(p.numel() for p in hf.parameters())


def test_kinds() -> None:
    c = param_counts(model_shape("gpt-oss-20b"))
    m = model_shape("gpt-oss-20b")
    assert c["embed"] == c["lm_head"] == m.vocab_size * m.hidden_size  # untied
    assert c["experts"] > 0.9 * sum(c.values()) and c["vision"] == 0
    tied = param_counts(model_shape("qwen3_5-0.8b"))
    assert tied["lm_head"] == 0 and tied["experts"] == 0 and tied["norm"] < 1e6
    assert param_counts(model_shape("qwen3-vl-2b"))["vision"] == 406_957_056  # transformers' count of the tower
