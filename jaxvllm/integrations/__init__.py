"""Bridges from jaxvllm to other tools; each is an optional extra.

- `jaxvllm.integrations.lm_eval`: the `jaxvllm` model for EleutherAI's lm-evaluation-harness
  (`pip install -e ".[eval]"`).
"""
