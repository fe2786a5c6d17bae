"""Small helpers with vLLM's module paths (`vllm.utils.argparse_utils`), for scripts that import them."""
