"""lm-evaluation-harness: the `jaxvllm` model against lm-eval's own `hf` model, offline.

Local tasks (YAML over JSON files written here) of every request type run through
`lm_eval.simple_evaluate` on one tiny checkpoint with both backends in one process:
multiple choice (loglikelihood, one context longer than max_length so both truncate),
loglikelihood with greedy and non-greedy continuations, generation with stop sequences,
and rolling loglikelihood over several windows. Per-request loglikelihoods agree within
1e-3, generated texts and every accuracy are identical. Skipped only without the `eval`
extra (lm-eval) or lm-eval's HF backend's accelerate.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra is not installed: pip install -e '.[eval]'")
pytest.importorskip("accelerate", reason="lm-eval's hf backend (the reference) needs accelerate (test extra)")

from jaxvllm.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)  # read by huggingface_hub / datasets when first imported

MAX_LENGTH = 96  # both backends score windows of this many tokens (rolling windows, truncation)
JAXVLLM_ARGS = f"dtype=float32,max_length={MAX_LENGTH},max_num_seqs=64,max_num_batched_tokens=256"
HF_ARGS = f"dtype=float32,device=cpu,max_length={MAX_LENGTH}"
TASKS = ["local_mc", "local_greedy", "local_gen", "local_roll"]
WORDS = ("the quick brown fox jumps over lazy dog paged cache stores keys values in fixed size blocks "
         "once upon a time there was small language model that lived on CPU hello world").split()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No download, whatever was imported before: the flags are also read at import time."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, name):
            monkeypatch.setattr(datasets.config, name, True)


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def greedy_docs(path: Path, rng: random.Random, hf_model) -> list[dict]:
    """Contexts with their greedy 1-2 token continuation (per HF) where the text re-encodes to
    the same tokens, each next to a random (non-greedy) one: `acc` of a loglikelihood task."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = hf_model(path)
    docs = []
    while len(docs) < 12:
        context = words(rng, 2, 8)
        ids = tok(context).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=rng.randint(1, 2), do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
        text = tok.decode(out)
        if text.strip() == text and text.isprintable() and tok(context + text).input_ids == ids + out:
            docs += [{"context": context, "target": text}, {"context": context, "target": " " + rng.choice(WORDS)}]
    return docs


def write_tasks(folder: Path, path: Path, hf_model) -> None:
    rng = random.Random(0)
    mc = [{"question": words(rng, 3, 12), "choices": [words(rng, 1, 4) for _ in range(4)], "answer": rng.randrange(4)}
          for _ in range(16)]
    mc[0]["question"] = words(rng, 120, 120)  # longer than max_length: truncated from the left
    data = {
        "mc": mc,
        "greedy": greedy_docs(path, rng, hf_model),
        "gen": [{"prompt": words(rng, 3, 10), "target": rng.choice(WORDS)} for _ in range(10)],
        "roll": [{"text": words(rng, 5, 150)} for _ in range(5)],  # up to ~3 windows of MAX_LENGTH
    }
    for name, docs in data.items():
        (folder / f"{name}.json").write_text(json.dumps(docs))

    def task(name: str, body: str) -> None:
        (folder / f"{name}.yaml").write_text(
            f"task: local_{name}\ndataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {folder / (name + '.json')}\n  cache_dir: {folder / 'hf-datasets'}\n"
            f"test_split: test\n{body}"
        )

    task("mc", 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
               'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
               "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    task("greedy", 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
                   'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: perplexity\n')
    task("gen", 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
                'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n  do_sample: false\n'
                "metric_list:\n  - metric: exact_match\n")
    task("roll", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                 "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, tiny_checkpoint, hf_model) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(folder, tiny_checkpoint("qwen3"), hf_model)
    return folder


@pytest.fixture(scope="module")
def runs(task_dir, tiny_checkpoint):
    """Both backends on the same tasks in one process: results, samples, wall times and the
    `LLM.generate` calls the jaxvllm model made."""
    import datasets.config
    import huggingface_hub.constants
    from lm_eval.tasks import TaskManager

    import lm_eval.models.huggingface  # noqa: F401  imported before the clocks, like the jaxvllm model

    import jaxvllm.integrations.lm_eval  # noqa: F401  registers "jaxvllm"

    path = tiny_checkpoint("qwen3")
    saved = huggingface_hub.constants.HF_HUB_OFFLINE, getattr(datasets.config, "HF_HUB_OFFLINE", None)
    huggingface_hub.constants.HF_HUB_OFFLINE = True  # module scope: the autouse fixture has not run yet
    if saved[1] is not None:
        datasets.config.HF_HUB_OFFLINE = True
    calls: list[tuple[int, float]] = []  # (prompts, seconds) of each LLM.generate
    original = LLM.generate

    def counting_generate(self, prompts, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, prompts, *args, **kwargs)
        finally:
            calls.append((len(prompts), time.perf_counter() - start))

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)  # only ours: no index of lm-eval's
    out = {}
    try:
        LLM.generate = counting_generate
        for name, args, batch_size in (("jaxvllm", JAXVLLM_ARGS, "auto"), ("hf", HF_ARGS, 16)):
            start = time.perf_counter()
            result = lm_eval.simple_evaluate(
                model=name, model_args=f"pretrained={path},{args}", tasks=TASKS, batch_size=batch_size,
                task_manager=tasks, log_samples=True, bootstrap_iters=0,
            )
            out[name] = result
            out[f"{name}_seconds"] = time.perf_counter() - start
    finally:
        LLM.generate = original
        huggingface_hub.constants.HF_HUB_OFFLINE = saved[0]
        if saved[1] is not None:
            datasets.config.HF_HUB_OFFLINE = saved[1]
    out["generate_calls"] = [n for n, _ in calls]
    print(f"\nlm-eval on {TASKS}, wall time of simple_evaluate (model load and warm-up included, task "
          f"indexing not): jaxvllm {out['jaxvllm_seconds']:.2f} s (of which its {len(calls)} LLM.generate calls "
          f"{sum(t for _, t in calls):.2f} s), hf {out['hf_seconds']:.2f} s")
    return out


def responses(run: dict, task: str) -> list:
    return [r for sample in sorted(run["samples"][task], key=lambda s: s["doc_id"]) for r in sample["resps"]]


def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    from jaxvllm.integrations.lm_eval import JaxvllmLM

    assert get_model("jaxvllm") is JaxvllmLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still found


def test_scoring_batches_dedupes_and_splits(tiny_checkpoint, monkeypatch):
    """Distinct token lists in one generate (in several past PROMPT_TOKENS_PER_CALL, same scores);
    an empty context scores after the prefix token; a long context is cut to max_length."""
    from lm_eval.api.instance import Instance

    import jaxvllm.integrations.lm_eval as integration

    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    lm = integration.JaxvllmLM(llm=llm)
    assert lm.max_length == 126
    rng = random.Random(1)
    pairs = [(words(rng, 2, 6), " " + words(rng, 1, 3)) for _ in range(6)]
    pairs += [pairs[0], ("", "Hello world"), (words(rng, 200, 200), " fox")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    calls: list[int] = []
    original = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **k: calls.append(len(prompts)) or
                        original(self, prompts, *a, **k))

    once = lm.loglikelihood(requests, disable_tqdm=True)
    assert calls == [len(pairs) - 1]  # the duplicate is scored once
    assert once[6] == once[0] and all(score < 0 for score, _ in once)
    monkeypatch.setattr(integration, "PROMPT_TOKENS_PER_CALL", 40)
    split = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(calls) > 3
    assert [g for _, g in split] == [g for _, g in once]
    assert [s for s, _ in split] == pytest.approx([s for s, _ in once], abs=1e-5)

    lm.shutdown()  # an LLM passed in belongs to the caller
    assert not llm.is_shutdown
    llm.shutdown()


@pytest.mark.slow
def test_loglikelihoods_match_hf(runs):
    for task in ("local_mc", "local_greedy"):
        ours, ref = responses(runs["jaxvllm"], task), responses(runs["hf"], task)
        assert len(ours) == len(ref) > 0
        for (a,), (b,) in zip(ours, ref):
            assert a[0] == pytest.approx(b[0], abs=1e-3)
            assert a[1] == b[1]  # is_greedy
    greedy = [r[0][1] for r in responses(runs["jaxvllm"], "local_greedy")]
    assert any(greedy) and not all(greedy)  # both kinds were scored


@pytest.mark.slow
def test_rolling_loglikelihoods_match_hf(runs):
    ours, ref = responses(runs["jaxvllm"], "local_roll"), responses(runs["hf"], "local_roll")
    assert len(ours) == 5
    for (a,), (b,) in zip(ours, ref):
        assert a == pytest.approx(b, abs=1e-3)


@pytest.mark.slow
def test_generations_match_hf(runs):
    ours, ref = responses(runs["jaxvllm"], "local_gen"), responses(runs["hf"], "local_gen")
    # (as lm-eval's vllm model: a generation cut inside a character has no U+FFFD at its end,
    # where the hf model's decode shows the broken bytes)
    assert ours == [[text.rstrip("\ufffd") for text in r] for r in ref] and len(ours) == 10
    assert all("\n" not in text and "." not in text for (text,) in ours)  # cut at the stop sequences


@pytest.mark.slow
def test_accuracies_identical(runs):
    ours, ref = runs["jaxvllm"]["results"], runs["hf"]["results"]
    for task, metric in (("local_mc", "acc,none"), ("local_mc", "acc_norm,none"), ("local_greedy", "acc,none"),
                         ("local_gen", "exact_match,none")):
        assert ours[task][metric] == ref[task][metric], (task, metric)
    for task, metric in (("local_greedy", "perplexity,none"), ("local_roll", "word_perplexity,none"),
                         ("local_roll", "bits_per_byte,none")):
        assert ours[task][metric] == pytest.approx(ref[task][metric], rel=1e-4), (task, metric)


@pytest.mark.slow
def test_requests_are_batched_through_the_engine(runs):
    """One `LLM.generate` per request type (loglikelihood, generate_until, rolling), not one per request."""
    calls = runs["generate_calls"]
    samples = runs["jaxvllm"]["samples"]
    num_loglikelihood = sum(len(s["arguments"]) for task in ("local_mc", "local_greedy") for s in samples[task])
    assert len(calls) == 3
    assert num_loglikelihood // 2 < calls[0] <= num_loglikelihood  # at once (identical token lists scored once)
    assert 10 in calls  # the generations


def test_do_sample_without_temperature_samples(tiny_checkpoint, monkeypatch):
    """lm-eval's vllm and hf backends sample at temperature 1.0 when a task sets do_sample and
    no temperature; greedy when do_sample is false or missing, or the temperature is 0."""
    from lm_eval.api.instance import Instance

    import jaxvllm.integrations.lm_eval as integration

    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    lm = integration.JaxvllmLM(llm=llm)
    asked: list[float] = []
    original = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params, *a, **k: asked.extend(
        p.temperature for p in params) or original(self, prompts, params, *a, **k))
    kwargs = [{"do_sample": True}, {"do_sample": True, "temperature": 0.5}, {"do_sample": False}, {},
              {"temperature": 0.0}]
    requests = [Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 2, **k}), i)
                for i, k in enumerate(kwargs)]
    assert len(lm.generate_until(requests, disable_tqdm=True)) == 5
    assert asked == [1.0, 0.5, 0.0, 0.0, 0.0]
    llm.shutdown()


def test_batch_size_is_refused_not_ignored(tiny_checkpoint):
    """lm-eval's batch_size: its default 1 and "auto" leave batching to the engine; a value
    that asks for something is refused, naming the engine arguments that do bound a step."""
    import jaxvllm.integrations.lm_eval as integration

    for fine in (None, 1, "1", "auto", "auto:4"):
        integration.check_batch_size(fine, None)
    for bad, max_bad in ((16, None), ("8", None), ("auto", 64)):
        with pytest.raises(ValueError, match="batches the requests by itself.*max_num_seqs"):
            integration.check_batch_size(bad, max_bad)
    with pytest.raises(ValueError, match="batch_size=16"):
        integration.JaxvllmLM(pretrained=str(tiny_checkpoint("qwen3")), batch_size=16)


@pytest.mark.slow
def test_command_line_wrapper(task_dir, tiny_checkpoint, tmp_path):
    """`python -m jaxvllm.integrations.lm_eval` is lm-eval's command line with `--model jaxvllm`."""
    path = tiny_checkpoint("qwen3")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "jaxvllm.integrations.lm_eval", "--model", "jaxvllm",
         "--model_args", f"pretrained={path},{JAXVLLM_ARGS}", "--tasks", "local_mc,local_gen",
         "--include_path", str(task_dir), "--limit", "4", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "local_mc" in result.stdout and "local_gen" in result.stdout and "acc" in result.stdout
    assert list((tmp_path / "out").rglob("results_*.json"))


def bos_checkpoint(path: Path, folder: Path) -> Path:
    """A copy of a tiny Llama whose tokenizer adds BOS itself, with a chat template that starts
    with the BOS text and refuses the system role (Gemma's and Mistral's templates do both)."""
    import shutil

    from tokenizers import Tokenizer, processors

    shutil.copytree(path, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_bos_chat_templates_and_special_stops_as_lm_eval_hf(tiny_checkpoint, tmp_path, monkeypatch):
    """What lm-eval's hf model does, on the same requests: `add_bos_token=True` puts a BOS
    before every string on a tokenizer that adds none itself, and no second one on a string
    that starts with it (a chat template's); a template that refuses the system role is
    applied again without it; a stop sequence that is one special token ends generation
    (the text leaves special tokens out, so it stops as a token id)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import jaxvllm.integrations.lm_eval as integration

    def both(path: Path, **kwargs):
        ours = integration.JaxvllmLM(pretrained=str(path), dtype="float32", max_length=64, **kwargs)
        return ours, HFLM(pretrained=str(path), dtype="float32", device="cpu", max_length=64, batch_size=2, **kwargs)

    scored = [("The capital of", " the dog"), ("<s>hello", " world")]
    requests = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(scored)]
    for path in (tiny_checkpoint("llama"), bos_checkpoint(tiny_checkpoint("llama"), tmp_path / "bos")):
        ours, hf = both(path, add_bos_token=True)
        for text in ("hello world", "<s><|user|>\nhello\n"):
            assert ours.tok_encode(text) == hf.tok_encode(text), (path.name, text)
        assert ours.tok_encode("hello world")[0] == 1
        for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(requests, True), hf.loglikelihood(requests, True)):
            assert abs(a - b) < 1e-3 and greedy_a == greedy_b
        ours.shutdown()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(history) == hf.apply_chat_template(history) == "<s><|user|>\nhello\n<|assistant|>\n"

    ours, hf = both(tiny_checkpoint("qwen3"))
    asked = []
    original = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params, *a, **k: asked.extend(params)
                        or original(self, prompts, params, *a, **k))
    # (this prompt's greedy continuation holds <s>, a special token, at its 13th token)
    request = [Instance("generate_until", {}, ("hello time paged world once keys brown stores",
                                               {"until": ["<s>"], "max_gen_toks": 24, "do_sample": False}), 0)]
    assert ours.generate_until(request, True) == hf.generate_until(request, True)
    assert 1 in asked[0].stop_token_ids
    ours.shutdown()


def test_reasoning_model_options(tiny_checkpoint, tmp_path, monkeypatch):
    """lm-eval's options for reasoning models, as its vllm model takes them: enable_thinking
    and chat_template_args reach the chat template; with think_end_token the answer is what
    follows it, the task's stop sequences cut only that (they stop nothing while it thinks)."""
    import shutil

    from lm_eval.api.instance import Instance

    import jaxvllm.integrations.lm_eval as integration
    from jaxvllm import SamplingParams

    path = tmp_path / "thinking"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking %}<think>{% endif %}[{{ style }}]")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="think_end_token is required"):
        integration.JaxvllmLM(pretrained=str(path), enable_thinking=True)
    with pytest.raises(ValueError, match="truncation_side='right' is not supported"):
        integration.JaxvllmLM(pretrained=str(path), truncation_side="right")
    with pytest.raises(ValueError, match="max_length=1000000 needs max_model_len 1000002 .* at most 2 below"):
        integration.JaxvllmLM(pretrained=str(path), max_length=10**6)
    # A check failing after the engine is built shuts it down (its memory was kept by the traceback).
    from jaxvllm import LLM

    shut, real = [], LLM.shutdown
    monkeypatch.setattr(LLM, "shutdown", lambda self: (shut.append(self), real(self))[1])
    with pytest.raises(ValueError, match=r"max_length 100 must be in \[1, max_model_len - 2 = 62\]"):
        integration.JaxvllmLM(pretrained=str(path), max_model_len=64, max_length=100)
    assert len(shut) == 1 and shut[0].llm_engine.runner.closed
    monkeypatch.undo()

    plain = integration.JaxvllmLM(pretrained=str(path), dtype="float32", max_model_len=64,
                                  chat_template_args={"style": "terse"})
    assert plain.llm.llm_engine.config.seed == 1234  # (lm-eval's vllm model's engine seed)
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi[terse]"
    prompt = "hello time paged world once keys brown stores"
    request = [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 16, "do_sample": False}), 0)]
    [whole] = plain.generate_until(request, True)
    marker = whole[len(whole) // 3:len(whole) // 3 + 2]
    after = whole.split(marker)[-1].lstrip()
    stop = after[len(after) // 2]  # (its first occurrence in the whole text may be in the thoughts)
    plain.shutdown()

    thinking = integration.JaxvllmLM(pretrained=str(path), dtype="float32", max_model_len=64, enable_thinking=True,
                                     think_end_token=marker, chat_template_args={"style": "terse"})
    assert thinking.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<think>[terse]"
    request = [Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 16, "do_sample": False}), 0)]
    assert thinking.generate_until(request, True) == [after.split(stop)[0]]
    thinking.shutdown()

    # A special token ends the thoughts (given by id, as lm-eval's hf model takes it): the text,
    # which leaves special tokens out, never shows it; the answer is the tokens after it.
    # (this prompt's greedy continuation holds <s>, id 1, at its 13th token)
    prompt = "hello time paged world once keys brown stores"
    plain = integration.JaxvllmLM(pretrained=str(path), dtype="float32", max_model_len=64)
    [out] = plain.llm.generate([{"prompt_token_ids": plain.tok_encode(prompt)}],
                               SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    assert 1 in ids[:-1]
    answer = plain.tokenizer.decode(ids[len(ids) - ids[::-1].index(1):], skip_special_tokens=True).lstrip()
    stopped = [Instance("generate_until", {}, (prompt, {"until": ["<s>"], "max_gen_toks": 24, "do_sample": False}), 0)]
    [before_special] = plain.generate_until(stopped, True)
    plain.shutdown()
    thinking = integration.JaxvllmLM(pretrained=str(path), dtype="float32", max_model_len=64, think_end_token="1")
    request = [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 24, "do_sample": False}), 0)]
    assert thinking.generate_until(request, True) == [answer]
    # and a stop sequence that is a special token stops there while it thinks too
    thinking.think_end_token = "@@ never written @@"
    assert thinking.generate_until(stopped, True) == [before_special]
    thinking.shutdown()
