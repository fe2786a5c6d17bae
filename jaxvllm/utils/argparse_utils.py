"""vLLM's `FlexibleArgumentParser`, which its example scripts build their command lines with."""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` that also reads `--max_model_len` as `--max-model-len`,
    as vLLM's does (vLLM's also reads YAML config files; this one does not)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    """`--a_b=c` -> `--a-b=c`; values and positional arguments are left alone."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
