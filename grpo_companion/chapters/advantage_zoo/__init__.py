"""Chapter 9, the advantage zoo on one exact yardstick."""
