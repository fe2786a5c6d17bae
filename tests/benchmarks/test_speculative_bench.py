"""--speculative-config on the command line, `bench latency|throughput --compare-speculative`
and the repeat dataset, on dummy:tiny (timing ratios are not asserted: CPU noise)."""

import argparse
import contextlib
import io
import json

import pytest
from transformers import AutoTokenizer

from jaxvllm.benchmarks import datasets as ds
from jaxvllm.cli import main
from jaxvllm.config import EngineConfig, SpeculativeConfig
from jaxvllm.dummy import resolve_model
from jaxvllm.engine_args import EngineArgs, add_engine_args, engine_kwargs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# test_bench.py's buckets (compiled once per session); room for the repeat prompts.
ENGINE = ["--max-model-len", "1024", "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--disable-tqdm",
          "--speculative-config", json.dumps(NGRAM)]
SPEC_KEYS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length"}
COMPARE_KEYS = SPEC_KEYS | {"output_tokens_per_second_spec", "output_tokens_per_second_no_spec", "speedup",
                            "identical_completions", "num_completions"}


def bench(tmp_path_factory, kind: str, *args: str) -> tuple[dict, str]:
    """The JSON report and the printed output of one bench command."""
    path = tmp_path_factory.mktemp(kind) / "report.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", kind, *ENGINE, "--output-json", str(path), *args]) == 0
    return json.loads(path.read_text()), out.getvalue()


@pytest.fixture(scope="module")
def dummy_tokenizer():
    with resolve_model("dummy:tiny") as source:
        yield AutoTokenizer.from_pretrained(source.path)


@pytest.fixture(scope="module")
def latency_compared(tmp_path_factory):
    return bench(tmp_path_factory, "latency", "--model", "dummy:tiny", "--dataset", "repeat", "--batch-size", "2",
                 "--output-len", "12", "--num-iters-warmup", "1", "--num-iters", "2", "--compare-speculative")


@pytest.fixture(scope="module")
def throughput_compared(tmp_path_factory):
    return bench(tmp_path_factory, "throughput", "--model", "dummy:tiny", "--dataset", "repeat", "--num-prompts", "4",
                 "--output-len", "12", "--compare-speculative")


# -- the flag -----------------------------------------------------------------------------------


def test_speculative_config_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert args.speculative_config == NGRAM
    with resolve_model("dummy:tiny") as source:
        kwargs = engine_kwargs(args, source)
        config = EngineConfig(model=source.path, **kwargs)
    assert kwargs["speculative_config"] == NGRAM
    assert config.speculative_config == SpeculativeConfig(**NGRAM) and config.async_scheduling is False
    engine_args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert engine_args.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "latency"], ["bench", "throughput"]])
@pytest.mark.parametrize("value, match", [
    ("{method: ngram}", "argument --speculative-config: not valid JSON"),
    ('["ngram", 4]', "argument --speculative-config: expected a JSON object"),
])
def test_bad_speculative_config_is_a_usage_error(capsys, command, value, match):
    assert main([*command, "--model", "dummy:tiny", "--speculative-config", value]) == 2
    assert match in capsys.readouterr().err


def test_a_config_the_engine_refuses_is_a_usage_error(capsys):
    assert main(["generate", "--model", "dummy:tiny", "--prompt", "hi",
                 "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "method 'medusa' is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_compare_speculative_needs_a_config_and_jaxvllm(capsys, kind):
    assert main(["bench", kind, "--model", "dummy:tiny", "--compare-speculative"]) == 2
    assert "--compare-speculative needs --speculative-config" in capsys.readouterr().err
    assert main(["bench", kind, "--model", "dummy:tiny", "--backend", "hf", "--compare-speculative",
                 "--speculative-config", json.dumps(NGRAM)]) == 2
    assert "--compare-speculative needs the jaxvllm backend" in capsys.readouterr().err


# -- the comparisons ----------------------------------------------------------------------------


@pytest.mark.parametrize("compared", ["latency_compared", "throughput_compared"])
def test_compare_speculative_reports_acceptance_and_ratio(request, compared):
    report, out = request.getfixturevalue(compared)
    s = report["speculative"]
    assert set(s) == COMPARE_KEYS
    assert 0 <= s["acceptance_rate"] <= 1 and 1 <= s["mean_accepted_length"] <= 1 + NGRAM["num_speculative_tokens"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert s["output_tokens_per_second_spec"] > 0 and s["output_tokens_per_second_no_spec"] > 0
    assert s["speedup"] == pytest.approx(s["output_tokens_per_second_spec"] / s["output_tokens_per_second_no_spec"])
    # Greedy: drafting changes how many tokens a step makes, not which.
    assert s["identical_completions"] == s["num_completions"] == 4
    results = report["results"]
    assert set(results) == {"jaxvllm", "jaxvllm_no_spec"} and "spec_decode" not in results["jaxvllm_no_spec"]
    assert results["jaxvllm"]["spec_decode"] == {k: s[k] for k in SPEC_KEYS}
    assert report["config"]["engine_args"]["speculative_config"] == NGRAM
    assert "speculative decoding: acceptance rate" in out and "speculative decoding off" in out


def test_latency_with_speculative_config_alone(tmp_path_factory):
    """One run: its acceptance over the timed iterations only (the warm-up's drafts left out)."""
    report, out = bench(tmp_path_factory, "latency", "--model", "dummy:tiny", "--batch-size", "2", "--input-len", "8",
                        "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "1")
    assert set(report["results"]) == {"jaxvllm"} and set(report["speculative"]) == SPEC_KEYS
    assert report["results"]["jaxvllm"]["output_tokens_per_second"] > 0
    assert "speculative decoding: acceptance rate" in out and "x); identical" not in out


# -- the repeat dataset ---------------------------------------------------------------------------


def test_repeat_requests(dummy_tokenizer):
    encode = ds.chat_encoder(dummy_tokenizer)
    reqs = ds.repeat_requests(20, 64, encode, seed=1)
    assert len(reqs) == 20 and all(r.output_len == 64 and r.structured_outputs is None for r in reqs)
    n = len(ds.REPEAT_PROMPTS)
    assert len({tuple(r.prompt_token_ids) for r in reqs[:n]}) == n  # each prompt once before any twice
    assert reqs == ds.repeat_requests(20, 64, encode, seed=1) != ds.repeat_requests(20, 64, encode, seed=2)
    assert all(r.prompt_len + 128 <= 1024 for r in reqs)
    text = dummy_tokenizer.decode(reqs[0].prompt_token_ids)
    assert text.startswith("<s>user\n") and text.endswith("<s>assistant\n")  # the chat template
    assert any(p in text for p in ds.REPEAT_PROMPTS)
    assert len(ds.repeat_requests(3, 8, encode)) == 3
    with pytest.raises(ValueError):
        ds.repeat_requests(0, 8, encode)


def test_repeat_prompts_fit_the_real_model(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    lengths = [len(ds.chat_encoder(tokenizer)(p)) for p in ds.REPEAT_PROMPTS]
    assert 50 < min(lengths) and max(lengths) < 300
