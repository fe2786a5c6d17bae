"""Small helpers with vLLM's module paths (`vllm.utils.argparse_utils`), for scripts that import them.
`from jaxvllm.utils import FlexibleArgumentParser` works too, as `from vllm.utils import ...` did
up to vLLM 0.10."""

import uuid

from jaxvllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "random_uuid"]


def random_uuid() -> str:
    """vLLM's request-id helper (`vllm.utils.random_uuid`): 32 hex digits."""
    return uuid.uuid4().hex
