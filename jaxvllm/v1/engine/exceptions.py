"""`from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError`, as servers
and RL workers catch them: jaxvllm's (`jaxvllm.async_llm`)."""

from jaxvllm.async_llm import EngineDeadError, EngineGenerateError

__all__ = ["EngineDeadError", "EngineGenerateError"]
