"""Chapter 13, the training-inference mismatch: the importance-sampling corrections of TRL and
verl in exact expectation."""
