"""The one Qwen3 model definition, its attention seam, checkpoints and tokenizers."""

from monorl.model.attention import AttentionContext, VarlenContext
from monorl.model.config import MODEL_SHAPES, ModelConfig, model_shape
from monorl.model.qwen3 import Qwen3ForCausalLM, build_model

__all__ = ["AttentionContext", "VarlenContext", "MODEL_SHAPES", "ModelConfig", "model_shape",
           "Qwen3ForCausalLM", "build_model"]
