"""Chapter 10, the group size G through the U-statistic view."""
