"""Speculative decoding: the n-gram proposer against vLLM's cases and a brute-force reference."""
