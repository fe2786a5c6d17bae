"""`get_tokenizer`, vLLM's tokenizer loader, which the engine uses too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxvllm.config import TOKENIZER_MODES


def get_tokenizer(tokenizer_name: str | Path, *args, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  revision: str | None = None, download_dir: str | None = None, **kwargs) -> Any:
    """vLLM's: the HF tokenizer in a local folder (never downloaded: `revision`,
    `download_dir` and `trust_remote_code` mean nothing here), fast unless
    tokenizer_mode="slow", truncating on the left unless `truncation_side` says otherwise.
    Other arguments go to `AutoTokenizer.from_pretrained`."""
    from transformers import AutoTokenizer

    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}")
    if tokenizer_mode == "slow":
        if kwargs.get("use_fast", False):
            raise ValueError("Cannot use the fast tokenizer in slow tokenizer mode.")
        kwargs["use_fast"] = False
    kwargs.setdefault("truncation_side", "left")  # (truncate_prompt_tokens keeps a text's last tokens)
    return AutoTokenizer.from_pretrained(tokenizer_name, *args, local_files_only=True, **kwargs)
