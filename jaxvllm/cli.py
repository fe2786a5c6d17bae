"""The `jaxvllm` command. Subcommands (generate, bench) arrive with the CLI issue."""

from __future__ import annotations

import argparse

import jaxvllm


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxvllm",
        description="jaxvllm: LLM inference on JAX/XLA. Use it from Python: "
        "`from jaxvllm import LLM, SamplingParams` (subcommands arrive with the CLI issue).",
    )
    parser.add_argument("--version", action="version", version=f"jaxvllm {jaxvllm.__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0
