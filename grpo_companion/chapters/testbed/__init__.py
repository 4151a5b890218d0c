"""Chapter 4, the language-model testbed: what the chapter shows of `grpo_companion.lm`."""
