"""Chapter 3, GRPO's loss: ratio clipping, the KL estimators and token aggregation."""
