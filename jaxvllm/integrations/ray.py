"""Batch inference over a Ray Dataset: one `LLM` per Ray actor (`pip install -e ".[ray]"`).

The pattern of vLLM's `ray.data.llm`: a config names the model, the engine arguments, how
many engine replicas run (`concurrency`) and how many rows each `generate` call gets
(`batch_size`); `build_llm_processor` turns it into a function `Dataset -> Dataset`.

    import ray
    from jaxvllm.integrations.ray import JaxvllmProcessorConfig, build_llm_processor

    config = JaxvllmProcessorConfig(model="weights/tiny-qwen3", engine_kwargs={"max_model_len": 512},
                                    concurrency=2, batch_size=64)
    processor = build_llm_processor(config, preprocess=lambda row: {
        "prompt": row["question"], "sampling_params": {"temperature": 0, "max_tokens": 32}})
    ds = processor(ray.data.from_items([{"question": "The capital of France is"}] * 1000))
    ds.show(3)

Rows. Each row carries
- `messages`: a chat (a list of {"role", "content"} dicts), rendered with the tokenizer's chat
  template (or the config's `chat_template`) as `LLM.chat` does; as Ray's chat stage, one that
  ends in an assistant message (a prefill) is continued (`continue_final_message`), and
  `messages` wins over a `prompt` the row also has (`{**row, "messages": ...}`),
- or one of `prompt` (a str) and `prompt_token_ids` (a list of token ids),
and optionally `sampling_params`: a dict of `SamplingParams` fields (vLLM's names), one per
row; a row without one takes `LLM.get_default_sampling_params()`. A null field counts as
absent (Arrow gives every row of a column the same fields, filling the missing ones with
nulls), so a field is at its `SamplingParams` default there, e.g. `max_tokens` at 16. Each
row gets one completion (`n` must be 1). `structured_outputs` is a dict of
`StructuredOutputsParams` fields (give a JSON schema as its text: Arrow would turn a dict
into a struct with a null for every key another row has). A row may also carry
`lora_path`, a LoRA adapter's PEFT folder (null: the base model), with `enable_lora=True`
in `engine_kwargs`: each replica gives each distinct path an adapter id of its own.

Outputs. Every input column is kept (every column `preprocess` returns, when given: as in
vLLM, its row replaces the input row, so `{**row, ...}` keeps the input's); added are
`generated_text`, `generated_tokens` (token ids), `finish_reason` ("stop" or "length"),
`num_input_tokens` and `num_generated_tokens`, and, where asked for, `logprobs` and
`prompt_logprobs` as Ray's vLLM stage gives them (per token, {token id: {"logprob", "rank",
"decoded_token"}}); then `postprocess` (row -> row) applies. Rows that `preprocess` and
`postprocess` return become columns as a Ray Data map makes them (an int-keyed dict, or a
field of several types, becomes Ray's pickled-object column). A bad row fails the batch, as
Ray's own stages do by default, with the row named in the error.

Replicas. Each replica is a Ray actor holding one `LLM` (built once, then fed batch after
batch); the rows of one batch go to ONE `LLM.generate` call, whose scheduler batches them.
An actor reserves `devices_per_replica` devices of the config's `accelerator` (by default
tensor_parallel_size * pipeline_parallel_size from `engine_kwargs`): `num_gpus` on "gpu",
the "TPU" resource on "tpu", CPUs on "cpu". On "cpu" the actors run JAX with
JAX_PLATFORMS=cpu, unless `runtime_env` sets it. Results are the same as one in-process
`LLM` over the same rows for greedy and for seeded sampling; unseeded sampling draws each
request's seed from its engine's seed and arrival order, so it differs from replica to replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import ray.data
from ray.data.block import BlockAccessor

from jaxvllm.chat_utils import render_chat
from jaxvllm.sampling_params import SamplingParams, StructuredOutputsParams

ACCELERATORS = ("cpu", "gpu", "tpu")


@dataclass
class JaxvllmProcessorConfig:
    """What runs where (vLLM's `vLLMEngineProcessorConfig`, with jaxvllm's names).

    model: a local checkpoint folder (vLLM's `model_source`).
    engine_kwargs: `LLM(model, **engine_kwargs)` in every replica.
    concurrency: the number of replicas, or (min, max) for an autoscaling pool.
    batch_size: rows per `LLM.generate` call.
    accelerator: "cpu", "gpu" or "tpu": the Ray resource each replica reserves.
    devices_per_replica: how many of them (None: tensor_parallel_size * pipeline_parallel_size).
    num_cpus: CPUs each replica reserves besides (on "cpu", None means devices_per_replica).
    runtime_env: the actors' Ray runtime environment (env_vars, ...).
    chat_template / chat_template_kwargs: for `messages` rows, as `LLM.chat`'s.
    """

    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 64
    accelerator: str = "cpu"
    devices_per_replica: int | None = None
    num_cpus: float | None = None
    runtime_env: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.model = str(self.model)
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if not _positive_int(self.batch_size):
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        sizes = self.concurrency if isinstance(self.concurrency, (tuple, list)) else (self.concurrency,)
        if not 1 <= len(sizes) <= 2 or not all(map(_positive_int, sizes)) or sizes[0] > sizes[-1]:
            raise ValueError(f"concurrency must be a positive int or a (min, max) pair, got {self.concurrency!r}")
        if self.devices_per_replica is None:
            kw = self.engine_kwargs
            self.devices_per_replica = kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)
        if not _positive_int(self.devices_per_replica):
            raise ValueError(f"devices_per_replica must be a positive int, got {self.devices_per_replica!r}")

    def actor_options(self) -> dict[str, Any]:
        """`Dataset.map_batches` keyword arguments: the actor pool, its resources and its runtime env."""
        n = self.devices_per_replica
        if isinstance(self.concurrency, (tuple, list)):
            pool = ray.data.ActorPoolStrategy(min_size=self.concurrency[0], max_size=self.concurrency[1])
        else:
            pool = ray.data.ActorPoolStrategy(size=self.concurrency)
        options: dict[str, Any] = {"compute": pool}
        if self.accelerator == "cpu":
            options["num_cpus"] = n if self.num_cpus is None else self.num_cpus
        else:
            options["num_cpus"] = 1 if self.num_cpus is None else self.num_cpus
            if self.accelerator == "gpu":
                options["num_gpus"] = n
            else:
                options["resources"] = {"TPU": n}
        runtime_env = dict(self.runtime_env or {})
        if self.accelerator == "cpu":  # keep JAX off any accelerator the actor did not reserve
            runtime_env["env_vars"] = {"JAX_PLATFORMS": "cpu", **runtime_env.get("env_vars", {})}
        if runtime_env:
            options["runtime_env"] = runtime_env
        return options


class JaxvllmPredictor:
    """The actor of one replica: an `LLM`, called on a pyarrow batch of rows (with the
    processor's `preprocess` and `postprocess` around it)."""

    def __init__(
        self,
        config: JaxvllmProcessorConfig,
        preprocess: Callable[[dict], dict] | None = None,
        postprocess: Callable[[dict], dict] | None = None,
    ) -> None:
        from jaxvllm.llm import LLM

        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        self.llm = LLM(config.model, **config.engine_kwargs)
        self._loras: dict[str, Any] = {}  # LoRA path -> its LoRARequest

    def __call__(self, batch: pa.Table) -> Any:
        """The batch's rows with their outputs, as a block of Ray's (`_table`)."""
        rows = _rows(batch)
        if self.preprocess is not None:
            rows = [self.preprocess(row) for row in rows]
        prompts, params, loras = [], [], []
        for i, row in enumerate(rows):
            try:
                prompts.append(self._prompt(row))
                params.append(self._sampling_params(row))
                loras.append(self._lora_request(row.get("lora_path")))
            except (ValueError, TypeError) as e:
                e.add_note(f"(row {i} of a batch of {len(rows)}: {_abridged(row)})")
                raise
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        # As Ray's vLLM stage: {token id: {"logprob", "rank", "decoded_token"}} per token, when asked for.
        asked = [name for name in ("logprobs", "prompt_logprobs") if any(getattr(p, name) is not None for p in params)]
        rows = [{**row, **self._output_columns(out, asked)} for row, out in zip(rows, outputs)]
        if self.postprocess is not None:
            rows = [self.postprocess(row) for row in rows]
        return _table(rows)

    @staticmethod
    def _output_columns(out, asked: list[str]) -> dict:
        completion = out.outputs[0]
        columns = {"generated_text": completion.text, "generated_tokens": list(completion.token_ids),
                   "finish_reason": completion.finish_reason, "num_input_tokens": len(out.prompt_token_ids),
                   "num_generated_tokens": len(completion.token_ids)}
        for name, per_token in (("logprobs", completion.logprobs), ("prompt_logprobs", out.prompt_logprobs)):
            if name in asked:
                columns[name] = None if per_token is None else [_logprob_dict(lp) for lp in per_token]
        return columns

    def _lora_request(self, path: str | None):
        from jaxvllm.lora.request import LoRARequest

        if path is None:
            return None
        if path not in self._loras:
            self._loras[path] = LoRARequest(Path(path).name, len(self._loras) + 1, path)
        return self._loras[path]

    def _prompt(self, row: dict) -> Any:
        """A row's prompt. `messages` wins over the other two, as in Ray's vLLM processor (its
        chat stage writes the rendered text over `prompt`), so `{**row, "messages": ...}` works."""
        if row.get("messages") is not None:
            return self._chat_prompt(list(row["messages"]))
        given = [key for key in ("prompt", "prompt_token_ids") if row.get(key) is not None]
        if len(given) != 1:
            raise ValueError(f"a row needs 'messages', or exactly one of 'prompt' or 'prompt_token_ids'; got {given}")
        if given[0] == "prompt":
            return row["prompt"]
        return {"prompt_token_ids": list(row["prompt_token_ids"])}

    def _chat_prompt(self, messages: list) -> dict:
        """`messages` rendered as `LLM.chat` renders them. As Ray's chat stage, a conversation
        that ends in an assistant message (a prefill) is continued rather than answered."""
        tokenizer = self.llm.get_tokenizer()
        if self.config.chat_template is None and tokenizer.chat_template is None:  # (naming where to pass one)
            raise ValueError("the tokenizer has no chat template; pass chat_template= in the processor config")
        messages = [_drop_nulls(m) if isinstance(m, dict) else m for m in messages]
        prefill = bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
        [text] = render_chat(tokenizer, [messages], chat_template=self.config.chat_template,
                             add_generation_prompt=not prefill, continue_final_message=prefill,
                             chat_template_kwargs=self.config.chat_template_kwargs)
        # As LLM.chat: the template writes any BOS itself, so no special tokens are added.
        return {"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}

    def _sampling_params(self, row: dict) -> SamplingParams:
        given = row.get("sampling_params")
        if given is None:
            return self.llm.get_default_sampling_params()
        fields = _drop_nulls(given)
        if "logit_bias" in fields:  # Arrow struct fields are named by strings
            fields["logit_bias"] = {int(k): v for k, v in _drop_nulls(fields["logit_bias"]).items()}
        if "structured_outputs" in fields:
            fields["structured_outputs"] = StructuredOutputsParams(**_drop_nulls(fields["structured_outputs"]))
        params = SamplingParams(**fields)
        if params.n != 1:
            raise ValueError(f"each row gets one completion: sampling_params n must be 1, got {params.n}")
        return params


def build_llm_processor(
    config: JaxvllmProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
) -> Callable[[ray.data.Dataset], ray.data.Dataset]:
    """A function `Dataset -> Dataset`: `preprocess` (row -> row, e.g. building `prompt`
    and `sampling_params`), the replicas' generation in batches of `config.batch_size`, then
    `postprocess` (row -> row; `{**row, ...}` keeps every column). Lazy, as Ray Data is:
    nothing runs until the dataset is consumed (take_all, write_parquet, ...).

    Unlike vLLM's, `preprocess` and `postprocess` run in the replicas, on each batch just
    before and after its `generate` call, rather than as Ray tasks of their own: a task
    needs a free CPU, which a cluster whose CPUs all went to the replicas (a CPU-only one)
    never has, and the job would wait forever."""

    def process(ds: ray.data.Dataset) -> ray.data.Dataset:
        return ds.map_batches(
            JaxvllmPredictor, fn_constructor_args=(config, preprocess, postprocess), batch_size=config.batch_size,
            batch_format="pyarrow", **config.actor_options(),
        )

    return process


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _rows(batch: pa.Table) -> list[dict]:
    """A table's rows as Python values (Ray's own columns, of tensors and pickled objects, too)."""
    return [dict(row) for row in BlockAccessor.for_block(batch).iter_rows(public_row_format=False)]


def _table(rows: list[dict]) -> Any:
    """Rows -> a block with every key of any row (a row without one gets a null there), as a
    Ray Data map makes it: Ray's column types for what Arrow lacks (int-keyed dicts, mixed
    types, n-d arrays), or a pandas block where Ray's object fallback is turned off."""
    names = dict.fromkeys(name for row in rows for name in row)
    return BlockAccessor.batch_to_block({name: [row.get(name) for row in rows] for name in names})


def _logprob_dict(logprobs: dict | None) -> dict | None:
    if logprobs is None:
        return None
    return {token: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in logprobs.items()}


def _abridged(row: dict, width: int = 200) -> str:
    text = repr(row)
    return text if len(text) <= width else text[: width - 3] + "..."


def _drop_nulls(fields: dict) -> dict:
    return {key: value for key, value in fields.items() if value is not None}
