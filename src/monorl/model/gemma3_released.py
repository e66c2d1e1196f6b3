"""google's released Gemma 3 text configs, as data (no imports: `monorl.model.config` reads them for its shapes)."""

# google's released Gemma 3 text config.json files (gemma-3-270m, gemma-3-1b-pt), the keys whose values differ from
# Gemma3TextConfig's defaults (transformers 5.25: the rest -- head_dim 256, query_pre_attn_scalar 256, rms_norm_eps
# 1e-6, tied embeddings, bos 2 / eos 1, every 6th layer full attention -- are its defaults too; the files' own copies
# are in tests/test_model_config_defaults.py). `monorl.model.config.MODEL_SHAPES` reads them with `from_hf` (#57)
_RELEASED = dict(model_type="gemma3_text", vocab_size=262_144, num_attention_heads=4, num_key_value_heads=1,
                 max_position_embeddings=32_768, sliding_window=512, rope_theta=1_000_000, rope_local_base_freq=10_000)
RELEASED = {"gemma3-270m": {**_RELEASED, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18},
            "gemma3-1b": {**_RELEASED, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26}}
