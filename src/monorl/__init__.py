"""monorl: RL post-training for language models in plain PyTorch."""
