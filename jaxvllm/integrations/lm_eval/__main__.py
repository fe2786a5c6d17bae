"""`python -m jaxvllm.integrations.lm_eval ARGS`: lm-eval's command line (`lm_eval ARGS`) with the
`jaxvllm` model registered, e.g.

    python -m jaxvllm.integrations.lm_eval --model jaxvllm --model_args pretrained=PATH --tasks hellaswag
"""

import jaxvllm.integrations.lm_eval  # noqa: F401  registers the "jaxvllm" model
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
