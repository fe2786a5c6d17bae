"""SamplingParams refuses NaN / inf / bools, accepts numpy scalars, and spots unsatisfiable params."""

import math

import numpy as np
import pytest

from jaxvllm.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        *[(dict({name: NAN}), rf"^{name} must be a finite number, got nan$") for name in FLOAT_FIELDS],
        *[(dict({name: INF}), rf"^{name} must be a finite number, got inf$") for name in FLOAT_FIELDS],
        *[(dict({name: -INF}), rf"^{name} must be a finite number, got -inf$") for name in FLOAT_FIELDS],
        (dict(temperature=np.float32("nan")), r"^temperature must be a finite number, got nan$"),
        (dict(temperature=np.float64("inf")), r"^temperature must be a finite number, got inf$"),
        (dict(top_p=np.float16("nan")), r"^top_p must be a finite number, got nan$"),
        (dict(temperature=10**400), r"^temperature must be a finite number, got 1000"),
        (dict(temperature=1e39), r"^temperature must be a finite number within float32 range, got 1e\+39$"),
        (dict(repetition_penalty=1e300), r"^repetition_penalty must be a finite number within float32 range"),
        (dict(logit_bias={3: NAN}), r"^logit_bias values must be a finite number, got nan$"),
        (dict(logit_bias={3: np.float32("inf")}), r"^logit_bias values must be a finite number, got inf$"),
        (dict(logit_bias={3: -(10**400)}), r"^logit_bias values must be a finite number, got -1000"),
        # Ranges still hold, for numpy scalars too.
        (dict(temperature=np.float32(-1)), r"^temperature must be non-negative, got -1.0.$"),
        (dict(top_p=np.float64(0.0)), r"^top_p must be in \(0, 1\], got 0.0.$"),
        (dict(top_k=np.int64(-2)), r"^top_k must be 0 \(disable\), or at least 1, got -2.$"),
        (dict(n=np.int32(0)), r"^n must be at least 1, got 0.$"),
        (dict(seed=2**64), r"^seed must be in \[-9223372036854775808, 18446744073709551615\], got 18446744073709551616.$"),
        (dict(max_tokens=np.int64(2), min_tokens=np.int64(3)), r"^min_tokens must be less than or equal to max_tokens=2, got 3.$"),
        # Bools are refused where numbers are expected, Python and numpy alike.
        (dict(temperature=True), r"^temperature must be a number, got True$"),
        (dict(top_p=np.bool_(True)), r"^top_p must be a number"),
        (dict(n=True), r"^n must be an int, got True$"),
        (dict(top_k=np.bool_(False)), r"^top_k must be an int"),
        (dict(logprobs=False), r"^logprobs must be an int, got False$"),
        (dict(stop_token_ids=[True]), r"^stop_token_ids must be non-negative token ids, got True$"),
        (dict(allowed_token_ids=[np.bool_(True)]), r"^allowed_token_ids must be non-negative token ids"),
        (dict(logit_bias={True: 1.0}), r"^logit_bias keys must be non-negative token ids, got True$"),
        (dict(logit_bias={3: True}), r"^logit_bias values must be a number, got True$"),
        # Floats (Python or numpy) are refused where ints are expected.
        (dict(max_tokens=np.float64(8.0)), r"^max_tokens must be an int"),
        (dict(top_k=2.0), r"^top_k must be an int, got 2.0$"),
        (dict(stop_token_ids=[np.float32(1)]), r"^stop_token_ids must be non-negative token ids"),
        (dict(allowed_token_ids=[NAN]), r"^allowed_token_ids must be non-negative token ids, got nan$"),
        (dict(logit_bias={NAN: 1.0}), r"^logit_bias keys must be non-negative token ids, got nan$"),
        (dict(stop_token_ids=[np.int64(-1)]), r"^stop_token_ids must be non-negative token ids"),
        (dict(temperature="0.5"), r"^temperature must be a number, got '0.5'$"),
        (dict(min_p=None), r"^min_p must be a number, got None$"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _assert_type(value, expected):
    assert type(value) is expected, f"{value!r} is {type(value).__name__}, not {expected.__name__}"


def test_numpy_scalars_are_accepted_and_normalized():
    p = SamplingParams(
        n=np.int8(2),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        top_k=np.int64(40),
        min_p=np.float16(0.25),
        presence_penalty=np.float32(-0.5),
        frequency_penalty=np.int32(1),
        repetition_penalty=np.float64(1.25),
        seed=np.uint32(2**32 - 1),
        max_tokens=np.int64(32),
        min_tokens=np.int16(4),
        logprobs=np.int64(5),
        prompt_logprobs=np.uint8(3),
        stop_token_ids=np.array([7, 8], np.int64),
        allowed_token_ids=[np.int32(1), np.int64(2), 3],
        logit_bias={np.int64(5): np.float32(-2.5), 6: np.int64(3), np.uint16(7): 1.5},
    )
    for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
        _assert_type(getattr(p, name), int)
    for name in FLOAT_FIELDS:
        _assert_type(getattr(p, name), float)
    assert (p.n, p.top_k, p.seed, p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (
        2, 40, 2**32 - 1, 32, 4, 5, 3)
    assert p.temperature == 0.5 and p.top_p == 0.9 and p.min_p == 0.25 and p.frequency_penalty == 1.0
    assert p.presence_penalty == -0.5 and p.repetition_penalty == 1.25
    assert p.stop_token_ids == [7, 8] and p.allowed_token_ids == [1, 2, 3]
    for t in p.stop_token_ids + p.allowed_token_ids:
        _assert_type(t, int)
    assert p.logit_bias == {5: -2.5, 6: 3.0, 7: 1.5}
    for k, v in p.logit_bias.items():
        _assert_type(k, int)
        _assert_type(v, float)


def test_python_numbers_still_work_and_floats_are_stored_as_float():
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2, logit_bias={1: 5})
    assert p.greedy and p.temperature == 0.0
    _assert_type(p.temperature, float)
    _assert_type(p.top_p, float)
    _assert_type(p.repetition_penalty, float)
    assert p.logit_bias == {1: 5.0}
    # Defaults are unchanged.
    d = SamplingParams()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens, d.seed, d.stop_token_ids) == (1.0, 1.0, 0, 16, None, [])
    assert math.isfinite(d.repetition_penalty) and not d.uses_penalties


def test_greedy_temperature_from_numpy_zero():
    assert SamplingParams(temperature=np.float32(0.0)).greedy


@pytest.mark.parametrize(
    "kwargs, eos, message",
    [
        # Every allowed id is EOS.
        (dict(allowed_token_ids=[2], min_tokens=1), [2], r"allowed_token_ids \[2\] are all stop tokens, so min_tokens=1 cannot be met"),
        # Every allowed id is EOS or a stop token id.
        (dict(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=3), (2, 0), r"min_tokens=3 cannot be met"),
        # Only stop_token_ids, with ignore_eos.
        (dict(allowed_token_ids=[9], stop_token_ids=[9], min_tokens=1, ignore_eos=True), [2], r"are all stop tokens"),
        # Only EOS, with ignore_eos: min_tokens masks it all the same (vLLM's `_all_stop_token_ids`).
        (dict(allowed_token_ids=[2], min_tokens=1, ignore_eos=True), [2], r"are all stop tokens"),
        # Several EOS ids, numpy ids.
        (dict(allowed_token_ids=[np.int64(4), 5], min_tokens=np.int32(2)), np.array([4, 5]), r"min_tokens=2 cannot be met"),
    ],
)
def test_check_satisfiable_refuses(kwargs, eos, message):
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=message):
        p.check_satisfiable(eos)


@pytest.mark.parametrize(
    "kwargs, eos",
    [
        (dict(allowed_token_ids=[2], min_tokens=0), [2]),  # no min_tokens: stopping at once is fine
        (dict(allowed_token_ids=[2, 3], min_tokens=1), [2]),  # 3 is left to sample
        (dict(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1), []),  # no EOS: 2 is left
        (dict(stop_token_ids=[9], min_tokens=4), [2]),  # no allowed_token_ids
        (dict(min_tokens=4), [2]),
        (dict(), [2]),
    ],
)
def test_check_satisfiable_accepts(kwargs, eos):
    assert SamplingParams(**kwargs).check_satisfiable(eos) is None
    SamplingParams(**kwargs).check_satisfiable(tuple(eos))


def test_clone_is_a_deep_copy():
    """vLLM's `SamplingParams.clone()`: the copy's fields change without touching the original."""
    p = SamplingParams(stop=["a"], logit_bias={3: 1.0}, seed=5)
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[4] = 2.0
    q.seed = 6
    assert q == SamplingParams(stop=["a", "b"], logit_bias={3: 1.0, 4: 2.0}, seed=6)
    assert p == SamplingParams(stop=["a"], logit_bias={3: 1.0}, seed=5)


def test_positional_arguments_are_vllms():
    """vLLM's SamplingParams takes n, then best_of, by position; its third field is a private
    one, so the others are taken by name only."""
    params = SamplingParams(2, 3)
    assert (params.n, params.best_of) == (2, 3)
    with pytest.raises(TypeError):
        SamplingParams(1, None, 0.5)
