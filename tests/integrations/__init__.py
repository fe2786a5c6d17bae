"""lm-evaluation-harness and Ray Data."""
