"""vLLM's prompt types: a prompt is a dict with text or token ids (and an optional cache salt)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

import numpy as np


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text of the ids, if known: the outputs' `prompt` (never tokenized)
    cache_salt: NotRequired[str]


def prompt_list(prompts: Any) -> list | tuple:
    """One prompt (a str or a dict) or a sequence of them (a list, or anything with a length
    to iterate over, as vLLM takes: a numpy array, a pandas Series, a datasets Column), as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return prompts
    # (a mapping or a DataFrame would iterate over its keys or column names)
    if isinstance(prompts, (bytes, bytearray, Mapping)) or hasattr(prompts, "columns") or \
            not (hasattr(prompts, "__len__") and hasattr(prompts, "__iter__")):
        raise TypeError(f"prompts must be a str, a dict or a sequence of them, got {type(prompts).__name__}")
    return [p.item() if isinstance(p, np.generic) else p for p in prompts]
