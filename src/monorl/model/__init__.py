"""The one decoder model definition (every family), its attention seam, checkpoints and tokenizers."""

from monorl.model.attention import AttentionContext, VarlenContext
from monorl.model.config import MODEL_SHAPES, ModelConfig, model_shape
from monorl.model.decoder import DecoderForCausalLM, build_model

__all__ = ["AttentionContext", "VarlenContext", "MODEL_SHAPES", "ModelConfig", "model_shape",
           "DecoderForCausalLM", "build_model"]
