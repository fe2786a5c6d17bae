"""The user-facing API: LLM, vLLM's semantics, beam search, engine arguments, the CLI, examples and notebooks."""
