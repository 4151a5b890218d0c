"""Chapter 2, the group baseline: GRPO's estimator in exact expectation."""
