"""vLLM's `FlexibleArgumentParser`, which its example scripts build their command lines with."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

# `--hf-overrides.rope_scaling.factor` or `-O.level`: one key of a JSON flag (not a value such as -0.5).
_DOTTED = re.compile(r"(--[A-Za-z][\w-]*|-O)\.")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` that reads command lines as vLLM's does: `--max_model_len`
    as `--max-model-len`, and a JSON flag one key at a time (`--hf-overrides.num_hidden_layers 2`,
    nested `--hf-overrides.rope_scaling.factor 2.0`, a list `--a.b+ x,y`, `-O.level 3`),
    the keys of one flag merged into one JSON object. (vLLM's also reads YAML config files
    through `--config`; this one does not.)"""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._merge_dotted([_dashed(a) for a in args]), namespace)

    def _merge_dotted(self, args: list[str]) -> list[str]:
        """The dotted keys of each of this parser's JSON flags as one `--flag JSON`, after the
        other options, as vLLM's (which a whole `--flag JSON` given before them loses to).
        Anything else, and everything after `--`, is left as it is."""
        kept: list[str] = []
        merged: dict[str, dict[str, Any]] = {}
        rest: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":  # (what follows is positional)
                rest = args[i:]
                break
            dotted = _DOTTED.match(arg)
            if not dotted or dotted.group(1) not in self._option_string_actions:  # (a value, or not this parser's)
                kept.append(arg)
                i += 1
                continue
            name, eq, text = arg.partition("=")
            if not eq:
                if i + 1 == len(args):
                    self.error(f"argument {name}: expected one argument")
                text, i = args[i + 1], i + 1
            i += 1
            if name.endswith("+"):  # (a list, its items separated by commas)
                name, value = name[:-1], text.split(",")
            else:
                try:
                    value = json.loads(text)
                except ValueError:
                    value = text
            flag, *keys = name.split(".")
            for key in reversed(keys):
                value = {key: value}
            _update(merged.setdefault(flag, {}), value)
        for flag, value in merged.items():
            kept += [flag, json.dumps(value)]
        return kept + rest


def _update(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Nested dicts merged, lists joined, anything else replaced (vLLM's merge)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _update(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            into[key] = value


def _dashed(arg: str) -> str:
    """`--a_b=c` -> `--a-b=c`, and `--a_b.c_d` -> `--a-b.c_d` (a JSON key keeps its name);
    values and positional arguments are left alone."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    flag, dot, keys = name.partition(".")
    return flag.replace("_", "-") + dot + keys + eq + value
