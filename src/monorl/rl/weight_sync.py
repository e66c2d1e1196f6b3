"""The weight sync the RL loop calls: `monorl.model.weight_sync` (it lives with the model it maps, so the generator
and the trainer need nothing from `rl/`)."""

from monorl.model.weight_sync import sync_weights_

__all__ = ["sync_weights_"]
