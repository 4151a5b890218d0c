"""Chapter 11, GRPO on GSM8K-style problems."""
