"""Chapter 8, baselines: when the group mean is the best baseline."""
