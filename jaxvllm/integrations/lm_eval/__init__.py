"""The `jaxvllm` model for EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`).

Importing this module registers the model with lm-eval, so that from Python

    import jaxvllm.integrations.lm_eval  # registers "jaxvllm"
    import lm_eval
    results = lm_eval.simple_evaluate(model="jaxvllm", model_args="pretrained=PATH,dtype=float32",
                                      tasks=["hellaswag"])

and from the shell (lm-eval finds models only in its registry, which holds no entry-point
hook in lm-eval 0.4.13; this wrapper imports the module, then runs lm-eval's own command
line with the same arguments):

    python -m jaxvllm.integrations.lm_eval --model jaxvllm \\
        --model_args pretrained=PATH,dtype=bfloat16,max_model_len=4096 --tasks hellaswag

`model_args`: `pretrained` (a local checkpoint folder, or `dummy:NAME` for random weights),
`max_length` (the token window scored at once, lm-eval's meaning; default max_model_len - 2,
since the engine also needs room for the one token each scoring request generates),
`max_gen_toks` (default 256), `add_bos_token`, `prefix_token_id`, the reasoning models' options
of lm-eval's `vllm` and `hf` models (`enable_thinking`, `chat_template_args`, passed to the chat
template, and `think_end_token`: a generation's text is what follows it, the task's stop
sequences applied to that answer only), and any `LLM(...)` engine
argument (`dtype`, `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
`gpu_memory_utilization`, `attention_backend`, ...; `seed` defaults to 1234, as lm-eval's
`vllm` model gives vLLM's engine). lm-eval's `batch_size` is not a knob here:
every request of a call goes to the engine at once, and its scheduler batches them
(continuous batching within `max_num_seqs` / `max_num_batched_tokens`, the engine arguments
that bound a step). So `batch_size` 1 (lm-eval's command-line default) and "auto" are
accepted, and any other value, or a `max_batch_size`, is refused with a message saying so.
`device` is accepted and ignored: JAX picks the device. From Python,
`JaxvllmLM(llm=an_existing_LLM)` reuses a loaded engine.

How each request type runs (all requests of one call in one `LLM.generate`, or a few past
PROMPT_TOKENS_PER_CALL prompt tokens):
- loglikelihood: context and continuation are tokenized as lm-eval's HF model does (the
  whole string encoded and split at the context's length, trailing spaces of the context
  moved to the continuation); the prompt is context + continuation (left-truncated to
  max_length + 1 tokens), generated with `max_tokens=1, prompt_logprobs=0` and
  `extra_args={"prompt_logprobs_start": first continuation position}`: only the continuation
  tokens meet the lm_head, and the context's blocks may come from the prefix cache. The
  prompts go in sorted order, so the choices of one document (and documents that share
  few-shot examples) are adjacent: the scheduler admits them together and the shared
  context's blocks are computed once. The score is the sum of the continuation tokens'
  prompt logprobs, greedy when each of them has rank 1. Identical token sequences are
  scored once; past PROMPT_TOKENS_PER_CALL prompt tokens the requests are split over
  several `generate` calls.
- loglikelihood_rolling: lm-eval's rolling windows (`get_rolling_token_windows`, context 1),
  each window a loglikelihood request as above, summed per document.
- generate_until: the context left-truncated to max_length - max_gen_toks tokens,
  `SamplingParams(temperature=0 unless the task samples, max_tokens=max_gen_toks,
  stop=until + [EOS text])`, the text then cut at the first stop sequence as lm-eval does.
  Special tokens are left out of the text, as lm-eval's `hf` model decodes (its `vllm`
  model keeps them, `skip_special_tokens=False`, unless a task's gen_kwargs say otherwise);
  a stop sequence that is one special token stops as that token's id. A generation cut
  inside a character ends before it, as the `vllm` model's (the `hf` model's decode ends in
  U+FFFD there).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import tempfile
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

import lm_eval.models  # noqa: F401  lm-eval's own models first: `get_model("hf")` must keep working
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxvllm.dummy import get_dummy, is_dummy, write_dummy_model
from jaxvllm.llm import LLM
from jaxvllm.lora.request import LoRARequest
from jaxvllm.sampling_params import PROMPT_LOGPROBS_START, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["JaxvllmLM"]

# Loglikelihood requests go to the engine together, in one `LLM.generate` up to this many prompt
# tokens (the outputs' token lists and scored logprobs are Python objects until the call returns).
PROMPT_TOKENS_PER_CALL = 1 << 19

# Generation kwargs of lm-eval tasks that map onto SamplingParams as they are.
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - {
    "n", "max_tokens", "stop", "detokenize", "logprobs", "prompt_logprobs", "temperature",
}


def check_batch_size(batch_size: Any, max_batch_size: Any) -> None:
    """lm-eval's batch_size means nothing to an engine that batches by itself: refuse a
    value that asks for something, rather than ignore it."""
    if batch_size is None or str(batch_size).strip() == "1" or str(batch_size).startswith("auto"):
        if max_batch_size is None:
            return
        asked = f"max_batch_size={max_batch_size}"
    else:
        asked = f"batch_size={batch_size}"
    raise ValueError(
        f"{asked}: jaxvllm's engine batches the requests by itself (continuous batching, every request of a "
        "task at once), so lm-eval's batch_size is not used; leave it at 1 or auto, and bound a step with the "
        "engine arguments max_num_seqs=N and max_num_batched_tokens=N in model_args"
    )


# The engine seed lm-eval's vllm model gives vLLM's LLM unless model_args name another, so
# that sampled generations without a per-request seed come out as there.
LM_EVAL_SEED = 1234


@register_model("jaxvllm")
class JaxvllmLM(TemplateLM):
    """lm-eval's model interface over a jaxvllm `LLM` (see the module docstring)."""

    _DEFAULT_MAX_GEN_TOKS = 256

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        llm: LLM | None = None,
        max_length: int | None = None,
        max_gen_toks: int = _DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        batch_size: Any = None,  # lm-eval's: 1 or "auto" only, the engine batches by itself
        max_batch_size: Any = None,
        device: Any = None,
        lora_local_path: str | None = None,
        enable_thinking: bool | None = None,
        chat_template_args: dict | None = None,
        think_end_token: str | None = None,
        truncation_side: str = "left",
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        check_batch_size(batch_size, max_batch_size)
        if enable_thinking and think_end_token is None:  # (lm-eval's message)
            raise ValueError(f"Got {enable_thinking=}, but {think_end_token=}. think_end_token is required when "
                             "using `enable_thinking=True`.")
        if truncation_side != "left":
            raise ValueError(f"truncation_side={truncation_side!r} is not supported: jaxvllm truncates a context "
                             "from the left, as lm-eval's hf model does")
        self._chat_template_args = {**(chat_template_args or {}),
                                    **({} if enable_thinking is None else {"enable_thinking": enable_thinking})}
        # lm-eval's vllm backend: one LoRA adapter (a PEFT folder) over the model, for every request
        self._lora = LoRARequest("finetuned", 1, str(lora_local_path)) if lora_local_path else None
        if self._lora is not None and llm is None:
            engine_kwargs.setdefault("enable_lora", True)
        self._dummy_dir: tempfile.TemporaryDirectory | None = None
        self.llm, self._owns_llm = llm, False
        try:  # (a failed set-up frees the engine it built now, not when its traceback goes)
            if llm is not None:
                if pretrained is not None or engine_kwargs:
                    raise ValueError("give either llm= (an existing LLM) or pretrained= with engine arguments, "
                                     "not both")
            else:
                engine_kwargs.setdefault("seed", LM_EVAL_SEED)
                self.llm, self._owns_llm = self._make_llm(pretrained, max_length, engine_kwargs), True
            self.tokenizer = self.llm.get_tokenizer()
            if add_bos_token is not None:  # (lm-eval's models load their tokenizer with it: a BOS, or none)
                self.tokenizer = copy.deepcopy(self.tokenizer)
                self.tokenizer.add_bos_token = add_bos_token
            self.max_model_len = self.llm.llm_engine.runner.max_model_len
            self._max_length = max_length if max_length is not None else self.max_model_len - 2
            if not 1 <= self._max_length <= self.max_model_len - 2:
                raise ValueError(
                    f"max_length {self._max_length} must be in [1, max_model_len - 2 = {self.max_model_len - 2}] "
                    "(a scored window of max_length tokens is a prompt of max_length + 1 tokens plus one generated)"
                )
            self._max_gen_toks = int(max_gen_toks)
            self.add_bos_token = add_bos_token
            self.custom_prefix_token_id = prefix_token_id
            if isinstance(think_end_token, int) or str(think_end_token).isdigit():  # (a token id, as lm-eval's hf)
                think_end_token = self.tokenizer.decode([int(think_end_token)], skip_special_tokens=False)
            self.think_end_token = think_end_token
            self._device = device
        except BaseException:
            self.shutdown()
            raise

    def _make_llm(self, pretrained: str | None, max_length: int | None, engine_kwargs: dict[str, Any]) -> LLM:
        if pretrained is None:
            raise ValueError("model_args needs pretrained=PATH (a local checkpoint folder) or pretrained=dummy:NAME")
        path, kwargs = str(pretrained), {}
        if is_dummy(path):  # random weights over a built-in config, written to a folder kept with the model
            spec = get_dummy(path)
            self._dummy_dir = tempfile.TemporaryDirectory(prefix="jaxvllm-lm-eval-")
            path = str(write_dummy_model(path, self._dummy_dir.name))
            kwargs.update(spec.engine_defaults, load_format="dummy")
        elif not Path(path).is_dir():
            raise FileNotFoundError(f"pretrained={path!r} is not a folder (jaxvllm loads local checkpoints only)")
        derived = max_length is not None and "max_model_len" not in engine_kwargs
        if derived:
            kwargs["max_model_len"] = int(max_length) + 2
        kwargs.update(engine_kwargs)
        try:
            return LLM(path, **kwargs)
        except ValueError as e:
            if derived and "max_model_len" in str(e):
                raise ValueError(f"max_length={max_length} needs max_model_len {kwargs['max_model_len']} (a scored "
                                 f"window of max_length tokens is a prompt of max_length + 1 tokens plus the one "
                                 f"token it generates): {e}; give a max_length at most 2 below it") from e
            raise

    # -- what lm-eval asks of a model -------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by (and rolling windows start with): BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> str:
        import jax

        return jax.default_backend()

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        runner = self.llm.llm_engine.runner
        return {"model_num_parameters": runner.cfg.num_params, "model_dtype": np.dtype(runner.dtype).name,
                "jaxvllm_max_model_len": self.max_model_len}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As lm-eval's models: a template that refuses the system role (Gemma's, Mistral's)
        gets the history without it, with a warning."""
        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt,
                                                      **self._chat_template_args)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            logger.warning("jaxvllm: the chat template failed; applying it again without the system role")
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """As lm-eval's HF model: the tokenizer's own special tokens unless told
        (`add_special_tokens`, else `add_bos_token`), none when the string already starts with
        the prefix token's text (a chat template's BOS) and the caller did not say."""
        special = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- loglikelihood ----------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """[(cache key, context ids, continuation ids)] -> [(sum of continuation logprobs, greedy)]."""
        windows = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            # As lm-eval's HF model: a window of at most max_length + 1 tokens, cut from the left.
            windows.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
        scores = self._score_windows(windows, disable_tqdm)
        for (key, _, _), answer in zip(requests, scores):
            if key is not None:  # rolling windows come without a key; their sum is cached per document
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return scores

    def _score_windows(self, windows: list[tuple[list[int], int]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Score the last n tokens of each token list through prompt logprobs from there on.

        The distinct token lists go to the engine together and sorted (shared contexts
        adjacent), in one `generate`, several only past PROMPT_TOKENS_PER_CALL prompt tokens."""
        need: dict[tuple[int, ...], int] = {}  # distinct token list -> the most continuation tokens asked of it
        for tokens, n in windows:
            key = tuple(tokens)
            need[key] = max(need.get(key, 0), n)
        scored: dict[tuple[int, ...], list[tuple[float, int]]] = {}  # per token: (logprob, rank), for the tail asked
        keys = sorted(need)
        start = 0
        while start < len(keys):
            end, total = start, 0
            while end < len(keys) and (end == start or total + len(keys[end]) <= PROMPT_TOKENS_PER_CALL):
                total += len(keys[end])
                end += 1
            chunk = keys[start:end]
            params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                     extra_args={PROMPT_LOGPROBS_START: len(key) - need[key]}) for key in chunk]
            outputs = self.llm.generate([{"prompt_token_ids": list(k)} for k in chunk], params, lora_request=self._lora,
                                        use_tqdm=not disable_tqdm)
            for key, out in zip(chunk, outputs):
                lps = out.prompt_logprobs
                scored[key] = [(lps[p][key[p]].logprob, lps[p][key[p]].rank) for p in range(len(key) - need[key], len(key))]
            start = end
        results = []
        for tokens, n in windows:
            tail = scored[tuple(tokens)][-n:]
            results.append((sum(lp for lp, _ in tail), all(rank == 1 for _, rank in tail)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scores: lm-eval's disjoint rolling windows of max_length tokens."""
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            doc = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            windows += doc
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        results, start = [], 0
        for req, count in zip(requests, counts):
            total = sum((score for score, _ in scores[start : start + count]), 0.0)
            start += count
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return results

    # -- generation -------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            # do_sample without a temperature samples at 1.0, as lm-eval's vllm and hf backends do.
            temperature = float(kwargs.pop("temperature", 1.0 if kwargs.pop("do_sample", False) else 0.0))
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len < 1:
                raise ValueError(f"max_gen_toks ({max_gen_toks}) leaves no room for a context in max_length "
                                 f"({self.max_length}); raise max_model_len")
            ids = self.tok_encode(context, left_truncate_len=max_ctx_len) or [self.prefix_token_id]
            ignored = sorted(set(kwargs) - _SAMPLING_FIELDS)
            if ignored:
                logger.warning("jaxvllm: ignoring generation kwargs %s", ignored)
            prompts.append({"prompt_token_ids": ids})
            sampling = {k: v for k, v in kwargs.items() if k in _SAMPLING_FIELDS}
            # A reasoning model's thoughts may hold the task's stop sequences: as lm-eval's vllm
            # model, only EOS stops it, and the stop sequences cut the answer after the thoughts.
            stop = [s for s in until if s and (s == eos or not self.think_end_token)]
            # A stop sequence that is one special token (<|im_start|>) never shows in the text,
            # which leaves special tokens out: it stops as a token id (lm-eval's hf model stops
            # on it, reading the text with special tokens), thinking or not.
            special = [self._special_ids[s] for s in until if s in self._special_ids]
            if special:
                sampling["stop_token_ids"] = [*sampling.get("stop_token_ids", ()), *special]
            params.append(SamplingParams(temperature=temperature, max_tokens=max_gen_toks, stop=stop or None,
                                         **sampling))
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm, lora_request=self._lora)
        results = []
        for req, out, until in zip(requests, outputs, stops):
            text, think_end = out.outputs[0].text, self.think_end_token
            if think_end in self._special_ids:  # (not in the text: the answer is the tokens after it)
                ids = list(out.outputs[0].token_ids)
                end = self._special_ids[think_end]
                if end in ids:
                    text = self.tokenizer.decode(ids[len(ids) - ids[::-1].index(end):], skip_special_tokens=True)
                text, think_end = text.lstrip(), None  # (as lm-eval strips the answer, found or not)
            text = postprocess_generated_text(text, until, think_end)
            results.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    @functools.cached_property
    def _special_ids(self) -> dict[str, int]:
        """Each special or added token's text -> its id."""
        added = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        named = dict(zip(self.tokenizer.all_special_tokens, self.tokenizer.all_special_ids))
        return {**added, **named}

    # -- lifecycle ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the engine's device memory (only an engine this object built; not one passed as llm=)."""
        if self._owns_llm:
            self.llm.shutdown()
        if self._dummy_dir is not None:
            self._dummy_dir.cleanup()
            self._dummy_dir = None
