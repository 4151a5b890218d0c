"""Chapter 1, the policy gradient: REINFORCE's error and a constant baseline's variance."""
