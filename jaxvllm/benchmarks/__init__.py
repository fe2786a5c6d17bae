"""Benchmarks that need no model or accelerator."""
