import sys

from jaxvllm.cli import main

sys.exit(main())
