"""vLLM's prompt types: a prompt is a dict with text or token ids (and an optional cache salt)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text of the ids, if known: the outputs' `prompt` (never tokenized)
    cache_salt: NotRequired[str]


def prompt_list(prompts: Any) -> list | tuple:
    """One prompt (a str or a dict) or a list of them, as a list."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")
    return prompts
