"""The models against HF transformers, their loading, and the built-in dummy models."""
