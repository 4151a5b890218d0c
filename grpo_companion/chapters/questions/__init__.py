"""Chapter 14, questions from TRL and verl runs: each answered on the exact sequence policy."""
