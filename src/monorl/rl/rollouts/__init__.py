"""Rollouts: prompts -> generated, scored groups (`producer`), and where the trainer takes each step's batch from
(`sources`: lock-step, ahead of the trainer, or received from generator ranks)."""
