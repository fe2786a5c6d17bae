"""SamplingParams: vLLM's names, defaults and ranges, validated when built."""

from __future__ import annotations

import copy
import enum
import logging
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from jaxvllm.config import check_bool, check_int, check_number


# extra_args key: prompt logprobs only from this prompt position on (an int >= 1), the
# positions before it None. The prefix cache may then serve the blocks before it, since
# their logprobs are not asked for: scoring a continuation (lm-eval's loglikelihood) costs
# its own tokens, and contexts that several requests share are computed once.
PROMPT_LOGPROBS_START = "prompt_logprobs_start"
# A positive temperature below this is raised to it, as vLLM's (`_MAX_TEMP`).
MIN_TEMPERATURE = 1e-2

logger = logging.getLogger(__name__)


def resolve_logprobs(k: int | None, vocab_size: int) -> int | None:
    """vLLM's -1 (for logprobs, prompt_logprobs and max_logprobs): the whole vocabulary."""
    return vocab_size if k == -1 else k


@dataclass
class StructuredOutputsParams:
    """What a completion must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON
    schema (`json`, a dict or its text), any JSON object (`json_object=True`), a regular
    expression, a `choice` of strings, an EBNF/GBNF or Lark `grammar`, or a `structural_tag`
    (JSON text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}).
    The others tune JSON: no whitespace between tokens, no properties beyond the schema's,
    or a whitespace pattern. (`disable_fallback` is accepted: there is one backend.)"""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.regex is not None, self.choice is not None, self.grammar is not None,
                 self.json_object is not None, self.structural_tag is not None]
        if sum(kinds) > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {self.__dict__}")
        if sum(kinds) < 1:
            raise ValueError(f"You must use one kind of structured outputs constraint but none are specified: {self.__dict__}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be True (or None), got {self.json_object!r}")


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, at every step with a new token
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    """vLLM's: how a request's tokens are drawn (`SamplingParams.sampling_type`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's deprecated name of `StructuredOutputsParams` (vLLM 0.11 warns, as here)."""

    def __post_init__(self) -> None:
        warnings.warn("GuidedDecodingParams is deprecated (as in vLLM 0.11); use StructuredOutputsParams instead",
                      DeprecationWarning, stacklevel=3)
        super().__post_init__()


@dataclass
class SamplingParams:
    """How to sample a request's completions (vLLM's `SamplingParams`).

    Processing order on device (as vLLM V1): logit_bias / allowed_token_ids / min_tokens
    masks, penalties, temperature, min_p, top_k, top_p; then sample (per-request seeded)
    or argmax when temperature is 0. Logprobs are of what the engine's `logprobs_mode`
    says: by default (vLLM's "raw_logprobs") of the raw model logits, else of the raw logits
    themselves or of the logits the sampler drew from; prompt logprobs are always of the
    raw model logits, as vLLM's.
    """

    # (in vLLM's order: n and best_of may be passed by position, the rest by name only, since
    # vLLM's third field is a private one)
    n: int = 1
    # vLLM V1's rules: best_of > 1 and per-request logits processors are refused when the
    # request is added (ValueError), with V1's messages.
    best_of: int | None = None
    _: KW_ONLY
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    include_stop_str_in_output: bool = False
    # Keep only the last k prompt tokens (-1: the last max_model_len - 1).
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The completion must match a JSON schema, regex, choice or grammar (llguidance masks
    # the tokens that cannot continue a match).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's deprecated name of structured_outputs: moved there, with vLLM 0.11's warning.
    guided_decoding: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Passed through untouched, for code of the user's that reads the params back, except
    # jaxvllm's one key: "prompt_logprobs_start" (`PROMPT_LOGPROBS_START`).
    extra_args: dict | None = None
    # Words whose token sequence may not be generated: its last token is masked when the
    # output so far ends with the rest of it (vLLM's rule, with and without a leading space).
    bad_words: list[str] | None = None
    # None: skip reading the prefix cache only when prompt_logprobs are asked for (as vLLM).
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        # Numbers may be Python or numpy scalars (not bools); they are stored as Python int/float.
        self.n = check_int("n", self.n, low=1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.temperature = check_number("temperature", self.temperature, low=0.0)
        if 0 < self.temperature < MIN_TEMPERATURE:  # vLLM's words and floor
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. "
                           "We have maxed it out to %s.", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self.top_p = check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = check_int("top_k", self.top_k, low=-1)
        self.min_p = check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.temperature == 0:  # greedy: the filters are off, as vLLM sets them
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.presence_penalty = check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self.repetition_penalty = check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.seed is not None and not isinstance(self.seed, bool) and self.seed == -1:
            self.seed = None  # vLLM's "no seed"
        if self.seed is not None:  # torch.Generator.manual_seed's range, which vLLM passes seeds to
            self.seed = check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, low=1)
        self.min_tokens = check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:  # vLLM reads True as 1
                value = 1
            if value is not None:
                value = check_int(name, value)
                if value < -1:
                    raise ValueError(f"{name} must be non-negative or -1, got {value}.")
                setattr(self, name, value)
        if self.best_of is not None:
            self.best_of = check_int("best_of", self.best_of, low=1)
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
                )
        if self.truncate_prompt_tokens is not None:
            value = check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if value == 0 or value < -1:
                raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {value}")
            self.truncate_prompt_tokens = value
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            if any(not w for w in words):
                raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={list(words)}")
            self.bad_words = list(dict.fromkeys(words))
        if self.guided_decoding is not None:
            warnings.warn("guided_decoding is deprecated (as in vLLM 0.11); use structured_outputs instead",
                          DeprecationWarning, stacklevel=3)
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        self.check_prompt_logprobs_start()
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize", "ignore_eos",
                     "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be True, False or None, got {self.skip_reading_prefix_cache!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = self.stop_strings  # (a list, as vLLM's: None and a str become one)
        self.bad_words = self.bad_words or []
        stop = self.stop
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        self.stop_token_ids = _token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            keys = _token_ids("logit_bias keys", list(self.logit_bias))
            # (vLLM adds any value: -inf bans a token; NaN and +inf would leave the row no distribution)
            biases = [v if _minus_infinity(v) else check_number("logit_bias values", v) for v in self.logit_bias.values()]
            self.logit_bias = dict(zip(keys, map(float, biases)))

    @staticmethod
    def from_optional(**fields) -> SamplingParams:
        """vLLM's constructor for API servers, which pass every field: None means the
        default for n, the penalties, temperature and top_p, and logit_bias may have string
        keys, its biases clamped to OpenAI's [-100, 100]."""
        for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p"):
            if name in fields and fields[name] is None:
                del fields[name]
        if fields.get("logit_bias") is not None:
            fields["logit_bias"] = {int(t): min(100.0, max(-100.0, b)) for t, b in fields["logit_bias"].items()}
        return SamplingParams(**fields)

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, whose fields a caller may change (output_kind, seed) without
        touching the original; as vLLM's, logits processors are shared, not copied."""
        return copy.deepcopy(self, memo={id(p): p for p in self.logits_processors or ()})

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list. The engine reads it (like every field) when a request is added,
        so an assignment after construction counts, as in vLLM."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_prompt_logprobs_start(self, num_prompt_tokens: int | None = None) -> None:
        """extra_args["prompt_logprobs_start"], when given: an int from 1 to the prompt's last
        position (checked again when a request is added, for extra_args set later)."""
        start = self.prompt_logprobs_start
        if start is None:
            return
        if self.prompt_logprobs is None:
            raise ValueError(f"extra_args[{PROMPT_LOGPROBS_START!r}] needs prompt_logprobs (0 for the tokens' own "
                             "logprobs and ranks only)")
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"extra_args[{PROMPT_LOGPROBS_START!r}] must be an integer >= 1 (the first prompt "
                             f"position scored; position 0 has no logprob), got {start!r}")
        if num_prompt_tokens is not None and start >= num_prompt_tokens:
            raise ValueError(f"extra_args[{PROMPT_LOGPROBS_START!r}]={start} is past the prompt's last position "
                             f"({num_prompt_tokens - 1}): no prompt logprob would be computed")

    @property
    def prompt_logprobs_start(self) -> int | None:
        """The first prompt position whose logprob is computed (extra_args["prompt_logprobs_start"]);
        None: every position from 1, vLLM's prompt_logprobs."""
        return (self.extra_args or {}).get(PROMPT_LOGPROBS_START)

    @property
    def reads_prefix_cache(self) -> bool:
        if self.skip_reading_prefix_cache is not None:
            return not self.skip_reading_prefix_cache
        # Prompt logprobs need every prompt token computed (vLLM's default), or those from
        # prompt_logprobs_start on: the blocks before it may come from the cache.
        return self.prompt_logprobs is None or self.prompt_logprobs_start is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sampling_type(self) -> SamplingType:
        if self.greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_supported(self, max_logprobs: int, vocab_size: int) -> None:
        """What vLLM V1 refuses when a request is added, with its messages; `max_logprobs`
        is the engine's (-1: the whole vocabulary)."""
        if self.best_of is not None and self.best_of > 1:
            raise ValueError("vLLM V1 does not yet support best_of.")
        if self.logits_processors:
            raise ValueError("vLLM V1 does not support per request user provided logits processors.")
        limit = resolve_logprobs(max_logprobs, vocab_size)
        asked = ((self.num_logprobs(vocab_size), "sample"), (self.num_prompt_logprobs(vocab_size), "prompt"))
        for wanted, kind in asked:
            if wanted is not None and wanted > limit:
                raise ValueError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {limit}")

    def num_logprobs(self, vocab_size: int) -> int | None:
        """How many top logprobs a sampled token gets (-1: the whole vocabulary)."""
        return resolve_logprobs(self.logprobs, vocab_size)

    def num_prompt_logprobs(self, vocab_size: int) -> int | None:
        return resolve_logprobs(self.prompt_logprobs, vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model: checked when a request is added."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or ():
                if t >= vocab_size:
                    raise ValueError(f"{name}: token id {t} is out of range [0, {vocab_size})")
        invalid = [t for t in self.logit_bias or {} if t >= vocab_size]
        if invalid:  # (vLLM's words)
            raise ValueError(f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                             f"{vocab_size}")

    def check_satisfiable(self, eos_token_ids: Sequence[int]) -> None:
        """Refuse parameters that contradict each other for this model: checked when a request is added.

        While fewer than min_tokens are generated the sampler masks the stop token ids (the
        EOS ids, even under ignore_eos as vLLM's, and stop_token_ids); if allowed_token_ids
        holds nothing else, no token would be left to sample.
        """
        if self.min_tokens <= 0 or self.allowed_token_ids is None:
            return
        stops = set(self.stop_token_ids or ()) | {int(t) for t in (() if eos_token_ids is None else eos_token_ids)}
        if stops.issuperset(self.allowed_token_ids):
            raise ValueError(
                f"allowed_token_ids {self.allowed_token_ids} are all stop tokens, so "
                f"min_tokens={self.min_tokens} cannot be met (stop tokens are masked until then)"
            )


def _token_ids(name: str, ids) -> list[int]:
    """Non-negative token ids (Python or numpy integers, not bools), as a list of Python ints."""
    ids = list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{name} must be non-negative token ids, got {t!r}")
    return [int(t) for t in ids]


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, for `LLM.beam_search`: keep the `beam_width` best sequences
    (by cumulative logprob over the sequence's length, its prompt included and a final end
    id not, to the power `length_penalty`, as vLLM's) for up to `max_tokens` steps.

    `temperature` goes to the per-step requests, whose logprobs (of the raw logits) rank the
    candidates. `include_stop_str_in_output` is accepted for vLLM's signature; like vLLM's
    offline beam search, `LLM.beam_search` always keeps a final EOS in the returned tokens.
    `skip_special_tokens`: how each sequence's `text` is decoded (vLLM's decodes them all).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        self.beam_width = check_int("beam_width", self.beam_width, low=1)
        self.max_tokens = check_int("max_tokens", self.max_tokens, low=1)
        self.temperature = check_number("temperature", self.temperature, low=0.0)
        self.length_penalty = check_number("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name, getattr(self, name))


def _minus_infinity(value) -> bool:
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == float("-inf")
    except OverflowError:  # (an int past float's range: check_number names it)
        return False
