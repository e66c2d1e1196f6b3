"""Qwen3.5-MoE's config.json keys beyond the shared ones (the `hf_module` of the qwen3_5_moe_text family:
`ModelConfig.from_hf` / `to_hf` call these): Qwen3.5's (`monorl.model.qwen3_5_hf`) and the shared expert's width.

transformers' `Qwen3_5MoeTextConfig` declares no intermediate_size, norm_topk_prob, decoder_sparse_step or
mlp_only_layers: its model routes every layer's MLP and always renormalises the top-k weights, whatever such keys
say (it keeps them as inert attributes). A config.json stating otherwise is refused (it would describe a model
transformers does not run); intermediate_size, which no layer of this family reads, is kept as given (else the
shared expert's width), so a config round-trips."""

from __future__ import annotations

from typing import Any

from monorl.model.qwen3_5_hf import _positive_int, hybrid_from_hf, hybrid_to_hf

# what transformers' Qwen3_5MoeSparseMoeBlock does, under the keys that would say otherwise (None: the key absent)
ROUTING = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _check_routing(hf: dict[str, Any]) -> None:
    for key, runs in ROUTING.items():
        v = hf.get(key)
        if v is not None and (type(v), v) != (type(runs), runs):
            raise ValueError(f"unsupported {key}={v!r}: Qwen3_5MoeForCausalLM routes every layer's MLP with "
                             f"renormalised top-k weights ({key} must be {runs!r} or absent)")


def from_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The family's `hf_module` hook: config.json as the shared reader reads it (the routing keys HF fixes filled
    in), and the Qwen3.5 and shared-expert fields."""
    from monorl.model.families import QWEN3_5_MOE

    _check_routing(hf)
    shared = _positive_int(hf, QWEN3_5_MOE.defaults, "shared_expert_intermediate_size")
    read = {**hf, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": None,
            "intermediate_size": hf.get("intermediate_size", shared)}
    return read, {**hybrid_from_hf(hf, QWEN3_5_MOE.defaults), "shared_expert_intermediate_size": shared}


def to_hf(cfg: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The family's `hf_module` hook: the shared config.json (its expert keys), Qwen3.5's keys, the shared
    expert's width."""
    if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers or not cfg.norm_topk_prob:  # (no key says so in HF's)
        raise ValueError("qwen3_5_moe_text routes every layer's MLP with renormalised top-k weights: "
                         "decoder_sparse_step=1, mlp_only_layers=(), norm_topk_prob=True")
    return {**out, **hybrid_to_hf(cfg), "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
