"""The language-model testbed: problems, reward, models, rollouts, trainer, gradients."""
