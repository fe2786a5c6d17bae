"""The benchmark scripts, run end to end at small sizes."""
