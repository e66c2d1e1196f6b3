"""Evaluating a model on a task's held-out prompts (`monorl eval`) and sampling from it (`monorl generate`)."""
