"""HF checkpoint load/save: bit-exact round trips, transformers reads what we write, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from monorl.model.attention import VarlenContext
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.hf_checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_config,
    load_pretrained,
    save_checkpoint,
)
from monorl.model.tokenizer import CharTokenizer, HFTokenizer


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ctx = VarlenContext.from_lengths([len(ids)], "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx.positions, ctx))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def safetensors_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.safetensors"))


# ---- round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["tiny", "tiny-untied"])
@pytest.mark.parametrize("shard", [None, 60_000])
def test_round_trip_bit_exact(tmp_path, shape, shard):
    model = build_model(model_shape(shape), seed=3)
    out = save_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=shard)
    files = safetensors_files(out)
    if shard is None:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    else:
        assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(model.state_dict())
    loaded = load_checkpoint(out)
    assert loaded.config == model.config
    assert_same_weights(model, loaded)
    assert not any(p.is_meta for p in loaded.parameters())


def test_round_trip_bf16_and_dtype_on_load(tmp_path):
    model = build_model(model_shape("tiny"), seed=4)
    out = save_checkpoint(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_checkpoint(out)
    assert_same_weights(model.to(torch.bfloat16), loaded)
    loaded32 = load_checkpoint(out, dtype=torch.float32)
    for name, t in loaded32.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, loaded.state_dict()[name].float()), name


def test_hf_round_trip_through_us(make_hf_checkpoint, load_hf_model, tmp_path):
    """HF checkpoint -> load -> save -> same tensors as HF wrote (sharded HF input too)."""
    src = make_hf_checkpoint(tie_word_embeddings=False, max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists()
    model = load_checkpoint(src)
    out = save_checkpoint(model, tmp_path / "copy")
    ours = load_file(out / "model.safetensors")
    theirs = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("tied, shard", [(True, None), (False, 50_000)])
def test_transformers_loads_what_we_save(tmp_path, load_hf_model, tied, shard):
    import transformers

    model = build_model(model_shape("tiny" if tied else "tiny-untied"), seed=5)
    out = save_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=shard)
    ref, info = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        b = ref.eval()(ids[None]).logits[0]
    assert (logits(model, ids) - b).abs().max().item() < 1e-4


def test_tied_checkpoint_with_lm_head_key_is_accepted(make_hf_checkpoint):
    path = make_hf_checkpoint(tie_word_embeddings=True)
    state = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    model = load_checkpoint(path)
    assert model.lm_head is None and torch.equal(model.lm_head_weight, state["model.embed_tokens.weight"])


def test_save_with_tokenizer_and_load_pretrained(tmp_path):
    model, tok = build_model(model_shape("tiny"), seed=6), CharTokenizer()
    out = save_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    loaded, loaded_tok = load_pretrained(out)
    assert_same_weights(model, loaded)
    assert isinstance(loaded_tok, HFTokenizer)
    text = "1 + 2 = 3\nok"
    assert loaded_tok.encode(text) == tok.encode(text)
    assert loaded_tok.eos_token_ids == tok.eos_token_ids and loaded_tok.pad_token_id == tok.pad_token_id


def test_save_replaces_existing_checkpoint(tmp_path):
    first, second = build_model(model_shape("tiny"), seed=7), build_model(model_shape("tiny"), seed=8)
    save_checkpoint(first, tmp_path / "ckpt", max_shard_bytes=60_000)
    save_checkpoint(second, tmp_path / "ckpt")  # single file now: the old shards must be gone
    assert safetensors_files(tmp_path / "ckpt") == ["model.safetensors"]
    assert_same_weights(second, load_checkpoint(tmp_path / "ckpt"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or old dirs left behind


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    class BrokenTokenizer(CharTokenizer):  # fails mid-save, after the weights are written
        def save(self, path):
            raise OSError("disk full")

    good = build_model(model_shape("tiny"), seed=9)
    save_checkpoint(good, tmp_path / "ckpt")
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(build_model(model_shape("tiny"), seed=10), tmp_path / "ckpt", tokenizer=BrokenTokenizer())
    assert_same_weights(good, load_checkpoint(tmp_path / "ckpt"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_refuses_meta_model_and_file_target(tmp_path):
    with torch.device("meta"):
        from monorl.model.decoder import DecoderForCausalLM

        meta = DecoderForCausalLM(model_shape("tiny"))
    with pytest.raises(CheckpointError, match="meta"):
        save_checkpoint(meta, tmp_path / "ckpt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_checkpoint(build_model(model_shape("tiny")), tmp_path / "file")


# ---- errors ----------------------------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A tiny untied checkpoint of our own, sharded into several files."""
    return save_checkpoint(build_model(model_shape("tiny-untied"), seed=11), tmp_path / "ckpt",
                           max_shard_bytes=30_000)


def test_error_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        load_checkpoint(tmp_path / "nope")
    assert "nope" in str(e.value)


def test_error_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(ckpt)


def test_error_missing_weights(tmp_path):
    out = save_checkpoint(build_model(model_shape("tiny")), tmp_path / "ckpt")
    (out / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights in .*model.safetensors"):
        load_checkpoint(out)


def test_error_unparsable_config(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(CheckpointError, match="cannot parse .*config.json"):
        load_checkpoint(ckpt)


def test_error_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture") as e:
        load_config(ckpt)
    assert str(ckpt / "config.json") in str(e.value) and "MistralForCausalLM" in str(e.value)


def test_error_shape_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vocab_size"] = 100
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert "model.embed_tokens.weight" in msg and "[128, 64]" in msg and "[100, 64]" in msg


def _edit_shard_holding(ckpt: Path, name: str, edit) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][name]
    state = load_file(shard)
    edit(state, index)
    save_file(state, shard, metadata={"format": "pt"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_error_missing_keys(ckpt):
    def drop(state, index):
        del state["model.layers.1.mlp.up_proj.weight"]
        del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]

    _edit_shard_holding(ckpt, "model.layers.1.mlp.up_proj.weight", drop)
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(ckpt)


def test_error_index_names_tensor_its_shard_lacks(ckpt):
    _edit_shard_holding(ckpt, "model.norm.weight", lambda state, index: state.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensors .*model\.norm\.weight"):
        load_checkpoint(ckpt)


def test_error_unexpected_keys(ckpt):
    def add(state, index):
        state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        state["model.extra.weight"] = torch.zeros(3)

    _edit_shard_holding(ckpt, "model.norm.weight", add)
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load_checkpoint(ckpt)
    assert "model.layers.0.self_attn.q_proj.bias" in str(e.value) and "model.extra.weight" in str(e.value)


def test_error_untied_checkpoint_without_lm_head(make_hf_checkpoint):
    path = make_hf_checkpoint(tie_word_embeddings=False)
    state = load_file(path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing .*lm_head\.weight"):
        load_checkpoint(path)


def test_error_index_names_missing_shard(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (ckpt / shard).unlink()
    with pytest.raises(CheckpointError, match=f"names shard '{shard}', which does not exist"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_error_corrupt_safetensors(ckpt, damage):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors file") as e:
        load_checkpoint(ckpt)
    assert shard.name in str(e.value)


def test_resume_refuses_another_architecture_by_every_field(tmp_path):
    """`check_architecture` compares every config field that shapes the weights or their meaning -- a Gemma 3's
    layer kinds and window, a Qwen3.5-MoE's shared expert -- and lets the token ids and the context length differ."""
    from monorl.run.checkpoints.files import check_architecture

    cfg = model_shape("tiny").with_family("gemma3_text").replace(
        layer_types=("sliding_attention", "full_attention"), num_layers=2, sliding_window=8)
    save_checkpoint(build_model(cfg), tmp_path)
    cfg = load_config(tmp_path)  # the run's policy as a run builds it: from the checkpoint's config.json
    check_architecture(tmp_path, cfg.replace(eos_token_id=7, max_position_embeddings=4 * cfg.max_position_embeddings))
    for other in (cfg.replace(sliding_window=16), cfg.replace(layer_types=("full_attention", "sliding_attention"))):
        with pytest.raises(CheckpointError, match="another model than the run's policy"):
            check_architecture(tmp_path, other)
