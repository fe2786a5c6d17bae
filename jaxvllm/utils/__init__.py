"""Small helpers with vLLM's module paths (`vllm.utils.argparse_utils`), for scripts that import them.
`from jaxvllm.utils import FlexibleArgumentParser` works too, as `from vllm.utils import ...` did
up to vLLM 0.10."""

from jaxvllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
