"""Chapter 3, GRPO's loss: importance sampling and the PPO surrogate, ratio clipping, the KL
estimators and token aggregation."""
