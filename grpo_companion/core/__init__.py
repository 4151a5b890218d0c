"""The math every chapter shares: pure functions on tensors, no language model."""
