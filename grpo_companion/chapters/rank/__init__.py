"""Chapter 7, the rank of GRPO's gradients: measurements, their verdicts and figures."""
