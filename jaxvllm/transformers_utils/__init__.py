"""vLLM's `vllm.transformers_utils` names that scripts import (`tokenizer.get_tokenizer`)."""
