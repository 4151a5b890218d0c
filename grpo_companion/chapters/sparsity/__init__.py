"""Chapter 6, gradient sparsity: the degenerate rate, its exact flow, runs and remedies."""
