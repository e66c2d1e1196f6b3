"""Gemma 3's config.json keys (`Gemma3TextConfig`), read and written the way transformers resolves them: the hooks
`ModelConfig.from_hf` / `to_hf` call for the `gemma3_text` family (`monorl.model.families.GEMMA3`).

Beyond the shared keys: `layer_types` (absent: every `sliding_window_pattern`-th layer full attention, the rest
sliding), `sliding_window`, `query_pre_attn_scalar`, and the RoPE base per layer kind: transformers 5 writes
`rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`; transformers 4 wrote `rope_theta`,
`rope_local_base_freq` and `rope_scaling` (the full-attention layers' scaling) at the top level."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from monorl.model.families import GEMMA3

if TYPE_CHECKING:
    from monorl.model.config import ModelConfig

KINDS = ("full_attention", "sliding_attention")

def from_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json as the shared reader reads it: the full-attention layers' RoPE as its rope_parameters, the extra
    `ModelConfig` fields: layer_types, sliding_window, rope_local_theta, query_pre_attn_scalar). ValueError (one
    line, naming the key) for what monorl does not run."""
    d = GEMMA3.defaults
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if (cap := hf.get(key, d[key])) is not None:
            raise ValueError(f"unsupported: {key}={cap!r} (monorl runs Gemma 3 without logit softcapping: null)")
    rope = hf.get("rope_parameters")
    if rope is not None and not (isinstance(rope, dict) and set(rope) <= set(KINDS)):
        raise ValueError(f"config.json: Gemma 3's rope_parameters must map {KINDS} to their RoPE, got {rope!r}")
    rope = rope or {}
    full = {"rope_type": "default", **(rope.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", d["rope_theta"]))
    local = {"rope_type": "default", **(rope.get("sliding_attention") or {})}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", d["rope_local_base_freq"]))
    if local["rope_type"] != "default" or len(local) != 2:
        raise ValueError(f"unsupported sliding_attention RoPE {local!r} (monorl: rope_type default, rope_theta)")
    local_theta = local["rope_theta"]
    if not (isinstance(local_theta, int | float) and not isinstance(local_theta, bool) and local_theta > 0):
        raise ValueError(f"config.json: rope_local_base_freq must be a positive number, got {local_theta!r}")

    layers = hf.get("num_hidden_layers", d["num_hidden_layers"])
    types = hf.get("layer_types", d["layer_types"])
    if types is None:  # HF: every pattern-th layer full attention (its kwarg sliding_window_pattern, default 6)
        pattern = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or any(t not in KINDS for t in types):
        raise ValueError(f"config.json: layer_types must list {KINDS} values, got {types!r}")
    window = hf.get("sliding_window", d["sliding_window"])
    if "sliding_attention" in types and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    scalar = hf.get("query_pre_attn_scalar", d["query_pre_attn_scalar"])
    if not (isinstance(scalar, int | float) and not isinstance(scalar, bool) and scalar > 0):
        raise ValueError(f"config.json: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    read = {**hf, "rope_parameters": full, "rope_scaling": None}
    extra = dict(layer_types=tuple(types), sliding_window=window if "sliding_attention" in types else 0,
                 rope_local_theta=float(local_theta), query_pre_attn_scalar=float(scalar))
    return read, extra


def to_hf(cfg: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    """The shared config.json `out` as Gemma3TextConfig reads it (transformers 4 and 5)."""
    out = {k: v for k, v in out.items() if k != "hidden_act"}
    full = out["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    out.update(
        hidden_activation=GEMMA3.activation[1], rope_local_base_freq=local["rope_theta"],
        rope_parameters={"full_attention": full, "sliding_attention": local},
        layer_types=[cfg.layer_type(i) for i in range(cfg.num_layers)],
        sliding_window=cfg.sliding_window or None,
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
    )
    return out
