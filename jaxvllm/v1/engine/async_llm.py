"""`from vllm.v1.engine.async_llm import AsyncLLM`, as vLLM's streaming example imports it:
jaxvllm's (`jaxvllm.async_llm`)."""

from jaxvllm.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
