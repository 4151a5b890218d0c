"""Chapter 5, credit assignment: exact credit, the k-step chain, and step-level training."""
