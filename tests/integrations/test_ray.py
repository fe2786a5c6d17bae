"""Ray Data batch inference (jaxvllm.integrations.ray) against one in-process LLM.

A local Ray cluster of 2 CPUs runs 64 rows (prompts and chats, greedy and seeded sampling,
per-row sampling params) through 2 replicas in batches of 32; every row's tokens, text and
finish reason equal those of one `LLM` in this process over the same rows. The in-process
reference runs first, so the replicas find its compiled steps in the persistent cache.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pyarrow as pa
import pytest
import ray

from jaxvllm.integrations.ray import JaxvllmPredictor, JaxvllmProcessorConfig, build_llm_processor
from jaxvllm.sampling_params import SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, token_buckets=[64])
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WORDS = "the quick brown fox jumps over a lazy dog while paged caches keep keys and values".split()
NUM_ROWS = 64


def make_rows() -> list[dict]:
    """Every 4th row a chat, the others prompts; even rows greedy, odd rows seeded sampling."""
    rows = []
    for i in range(NUM_ROWS):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 7))
        if i % 2 == 0:
            params = {"temperature": 0.0, "max_tokens": 4 + i % 9}
        else:
            params = {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i, "max_tokens": 4 + i % 9}
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}] if i % 4 == 3 else None
        rows.append({"id": i, "prompt": None if chat else text, "messages": chat, "sampling_params": params})
    return rows


def params_of(row: dict) -> SamplingParams:
    return SamplingParams(**row["sampling_params"])


@pytest.fixture(scope="module")
def config(tiny_checkpoint) -> JaxvllmProcessorConfig:
    return JaxvllmProcessorConfig(model=tiny_checkpoint("qwen3"), engine_kwargs=ENGINE, concurrency=2,
                                  batch_size=32, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def predictor(config):
    """A replica's actor class, built in this process (no Ray)."""
    predictor = JaxvllmPredictor(config)
    yield predictor
    predictor.llm.shutdown()


@pytest.fixture(scope="module")
def reference(predictor) -> dict[int, tuple]:
    """id -> (token ids, text, finish reason) of one in-process LLM: generate and chat."""
    llm, rows = predictor.llm, make_rows()
    prompts = [r for r in rows if r["prompt"] is not None]
    chats = [r for r in rows if r["messages"] is not None]
    outputs = llm.generate([r["prompt"] for r in prompts], [params_of(r) for r in prompts], use_tqdm=False)
    outputs += llm.chat([r["messages"] for r in chats], [params_of(r) for r in chats], chat_template=TEMPLATE,
                        use_tqdm=False)
    return {r["id"]: (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for r, o in zip(prompts + chats, outputs)}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster of 2 CPUs, whose actor pools start every actor before the first batch
    (otherwise the replica up first may take every batch, and the test would not show two)."""
    ray.init(num_cpus=2, include_dashboard=False)
    context = ray.data.DataContext.get_current()
    wait, context.wait_for_min_actors_s = context.wait_for_min_actors_s, 300
    yield
    context.wait_for_min_actors_s = wait
    ray.shutdown()


def test_two_replicas_match_one_llm(ray_cluster, config, reference):
    def preprocess(row):  # defined here, so that Ray ships it by value to the workers
        return {**row, "tag": f"row-{row['id']}"}

    def postprocess(row):  # runs in the replica: its process id tells which one did the row
        return {**row, "text_chars": len(row["generated_text"]), "replica": os.getpid()}

    processor = build_llm_processor(config, preprocess=preprocess, postprocess=postprocess)
    out = sorted(processor(ray.data.from_items(make_rows())).take_all(), key=lambda r: r["id"])

    assert [r["id"] for r in out] == list(range(NUM_ROWS))
    greedy = sampled = chats = 0
    for row, given in zip(out, make_rows()):
        i = row["id"]
        assert (list(row["generated_tokens"]), row["generated_text"], row["finish_reason"]) == reference[i], i
        assert row["num_generated_tokens"] == len(reference[i][0]) and row["num_input_tokens"] > 0
        assert row["tag"] == f"row-{i}" and row["text_chars"] == len(row["generated_text"])
        assert row["prompt"] == given["prompt"]  # the input columns are kept
        greedy += given["sampling_params"]["temperature"] == 0
        sampled += given["sampling_params"]["temperature"] > 0
        chats += given["messages"] is not None
    assert (greedy, sampled, chats) == (32, 32, 16)
    replicas = {row["replica"] for row in out}
    assert len(replicas) == 2 and os.getpid() not in replicas  # a batch each


def test_predictor_batch_in_process(predictor, reference):
    """One pyarrow batch as Ray Data hands it over: nulls filled in by Arrow are defaults,
    input columns stay, output columns of the same name are replaced."""
    rows = make_rows()[:8]
    table = pa.Table.from_pylist([{**r, "generated_text": "old"} for r in rows])
    assert table.column("sampling_params").type.get_field_index("seed") >= 0  # greedy rows: seed=null
    out = predictor(table).to_pylist()
    for row, given in zip(out, rows):
        assert (row["generated_tokens"], row["generated_text"], row["finish_reason"]) == reference[given["id"]]
        assert row["messages"] == given["messages"] or (row["messages"] is None) == (given["messages"] is None)
    ids = predictor(pa.Table.from_pylist([{"prompt_token_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0}},
                                          {"prompt_token_ids": [5], "sampling_params": {"logit_bias": {"9": 100.0}}}]))
    assert ids.column("num_input_tokens").to_pylist() == [3, 1]
    assert ids.column("num_generated_tokens").to_pylist() == [16, 16]  # SamplingParams' default max_tokens
    assert ids.column("generated_tokens").to_pylist()[1] == [9] * 16  # logit_bias keys: Arrow's str -> int
    constrained = predictor(pa.Table.from_pylist([
        {"prompt": "a", "sampling_params": {"temperature": 0.0, "structured_outputs": {"regex": r"\d{3}"}}},
        {"prompt": "b", "sampling_params": {"temperature": 0.0, "structured_outputs": {"choice": ["x", "yz"]}}},
    ]))
    text = constrained.column("generated_text").to_pylist()
    assert re.fullmatch(r"\d{3}", text[0]) and text[1] in ("x", "yz")


def test_predictor_takes_the_rows_a_ray_map_takes(predictor):
    """As in Ray's vLLM processor, whose preprocess / postprocess are Ray Data maps: rows with
    int-keyed dicts or a field a str in one row and a list in another; `messages` over a
    `prompt` kept by `{**row, ...}`, rendered as LLM.chat renders them (content parts too); a
    conversation ending in an assistant message continued; logprobs when asked for."""
    llm = predictor.llm
    chat = [{"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "fox"}]}]
    prefill = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "The colour is"}]
    greedy = {"temperature": 0.0, "max_tokens": 5}

    def preprocess(row):
        extra = {"messages": {0: chat, 1: prefill}[row["i"]]} if row["i"] < 2 else {}
        stop = "zz" if row["i"] % 2 else ["zz", "yy"]
        bias = {9: 100.0} if row["i"] == 3 else {}
        return {**row, **extra, "sampling_params": {**greedy, "stop": stop, "logit_bias": bias, "logprobs": 2}}

    predictor.preprocess = preprocess
    predictor.postprocess = lambda row: {**row, "counts": {t: 1 for t in row["generated_tokens"]}}
    try:
        out = predictor(pa.Table.from_pylist([{"i": i, "prompt": "a lazy dog"} for i in range(4)])).to_pylist()
    finally:
        predictor.preprocess = predictor.postprocess = None
    sp = SamplingParams(**greedy, logprobs=2)
    want = [llm.chat(chat, sp, chat_template=TEMPLATE, use_tqdm=False)[0],
            llm.chat(prefill, sp, chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True,
                     use_tqdm=False)[0],
            llm.generate("a lazy dog", sp, use_tqdm=False)[0]]
    assert [row["generated_tokens"] for row in out[:3]] == [list(o.outputs[0].token_ids) for o in want]
    assert want[1].prompt_token_ids != llm.chat(prefill, sp, chat_template=TEMPLATE, use_tqdm=False)[0].prompt_token_ids
    assert out[3]["generated_tokens"] == [9] * 5 and out[3]["counts"] == {9: 1}
    for row, o in zip(out, want):  # Ray's form: {token id: {"logprob", "rank", "decoded_token"}} per token
        assert [sorted(d) for d in row["logprobs"]] == [sorted(d) for d in o.outputs[0].logprobs]
        token = o.outputs[0].token_ids[0]
        assert row["logprobs"][0][token] == pytest.approx(
            {"logprob": o.outputs[0].logprobs[0][token].logprob, "rank": o.outputs[0].logprobs[0][token].rank,
             "decoded_token": o.outputs[0].logprobs[0][token].decoded_token})
    assert "prompt_logprobs" not in out[0]  # (not asked for)


def test_predictor_gives_a_pandas_block_where_ray_would(predictor, monkeypatch):
    """With Ray's object fallback turned off, rows Arrow cannot hold make a pandas block, as
    Ray's own map makes it (it failed on pyarrow-only methods)."""
    import pandas as pd

    monkeypatch.setattr(ray.data.DataContext.get_current(), "enable_fallback_to_arrow_object_ext_type", False)
    stops = ["zz", ["zz", "yy"]]
    monkeypatch.setattr(predictor, "preprocess", lambda row: {**row, "sampling_params": {
        "temperature": 0.0, "max_tokens": 3, "stop": stops[row["i"]]}})
    out = predictor(pa.Table.from_pylist([{"i": 0, "prompt": "a lazy dog"}, {"i": 1, "prompt": "a lazy dog"}]))
    assert isinstance(out, pd.DataFrame) and list(out["num_generated_tokens"]) == [3, 3]
    assert list(out["generated_tokens"][0]) == list(out["generated_tokens"][1])


def test_predictor_refuses_bad_rows(predictor, config, monkeypatch):
    with pytest.raises(ValueError, match="exactly one of") as error:
        predictor(pa.Table.from_pydict({"prompt": ["b", "a"], "prompt_token_ids": [None, [1, 2]]}))
    assert "(row 1 of a batch of 2: {'prompt': 'a', 'prompt_token_ids': [1, 2]})" in error.value.__notes__
    with pytest.raises(ValueError, match="n must be 1"):
        predictor(pa.Table.from_pylist([{"prompt": "a", "sampling_params": {"n": 2}}]))
    monkeypatch.setattr(predictor, "config", dataclasses.replace(config, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):  # the tiny tokenizer has none
        predictor(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "hi"}]}]))


def test_config_resources():
    cpu = JaxvllmProcessorConfig(model="m", concurrency=3, runtime_env={"env_vars": {"A": "1"}}).actor_options()
    assert cpu["compute"].min_size == cpu["compute"].max_size == 3
    assert cpu["num_cpus"] == 1 and "num_gpus" not in cpu
    assert cpu["runtime_env"] == {"env_vars": {"JAX_PLATFORMS": "cpu", "A": "1"}}
    gpu = JaxvllmProcessorConfig(model="m", accelerator="gpu", engine_kwargs={"tensor_parallel_size": 2},
                                 concurrency=(1, 4)).actor_options()
    assert gpu["num_gpus"] == 2 and gpu["num_cpus"] == 1 and "runtime_env" not in gpu
    assert (gpu["compute"].min_size, gpu["compute"].max_size) == (1, 4)
    tpu = JaxvllmProcessorConfig(model="m", accelerator="tpu", devices_per_replica=4).actor_options()
    assert tpu["resources"] == {"TPU": 4}
    for bad in (dict(accelerator="npu"), dict(batch_size=0), dict(concurrency=(3, 1)), dict(concurrency=0),
                dict(devices_per_replica=0)):
        with pytest.raises(ValueError):
            JaxvllmProcessorConfig(model="m", **bad)
