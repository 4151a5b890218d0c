"""Reference implementations of the math in the GRPO book."""
