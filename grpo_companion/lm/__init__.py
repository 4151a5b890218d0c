"""The language-model testbed: problems and reward, models, rollouts, the trainer, per-example gradients."""
