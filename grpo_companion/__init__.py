"""The library behind the GRPO Companion book, in four layers; imports only point down.

- `grpo_companion.core`: the math every chapter shares, on tensors (torch only): the enumerable
  sequence policy and the policy gradient, group advantages, GRPO losses, exact group estimators
  and their moments, statistics helpers.
- `grpo_companion.lm`: the language-model testbed (transformers): problems and reward, models,
  rollouts, the GRPO trainer, per-example gradients.
- `grpo_companion.chapters`: one module per chapter, what that chapter computes; it imports the
  two layers above and never another chapter's module.
- `grpo_companion.machinery`: the book's machinery (papermill pipeline, report, claims engine,
  Sphinx extension, command line); it imports no chapter code.
"""
