"""Attention at the ops layer: `kernel`, the one Triton attention kernel (varlen-causal, paged decode, a turn's
cached prefill); `invariant`, the batch-invariant attention ops built on it (an exact CPU path elsewhere)."""
