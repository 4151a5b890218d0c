"""The library behind the GRPO Companion book, in four layers; imports only point down.

- `grpo_companion.core`: the math every chapter shares, on tensors (torch only): the enumerable
  sequence policy and the policy gradient, group advantages, GRPO losses, exact group estimators
  and their moments, statistics helpers.
- `grpo_companion.lm`: the language-model testbed (transformers): problems and reward, models,
  rollouts, the GRPO trainer, per-example gradients.
- `grpo_companion.chapters`: one folder per chapter, what that chapter computes; it imports the
  two layers above and never another chapter's module.
- `grpo_companion.machinery`: the book's machinery (papermill pipeline, report, claims engine,
  Sphinx extension, command line); it imports no chapter code.

Beneath them, `grpo_companion.reproducibility` pins the CPU kernels' code path and thread count
when the package is imported, before torch or numpy load (`reproducibility.pin`).
"""

from grpo_companion.reproducibility import MachineError, pin

try:
    pin()
except MachineError as error:
    raise SystemExit(f"grpo_companion: {error}") from None
