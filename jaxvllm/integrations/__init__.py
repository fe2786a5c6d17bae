"""Bridges from jaxvllm to other tools; each is an optional extra.

- `jaxvllm.integrations.lm_eval`: the `jaxvllm` model for EleutherAI's lm-evaluation-harness
  (`pip install -e ".[eval]"`).
- `jaxvllm.integrations.ray`: batch inference over a Ray Dataset, one `LLM` per Ray actor
  (`pip install -e ".[ray]"`).
"""
