"""SamplingParams: defaults, normalization and validation."""
import pytest

from baton.sampling_params import SamplingParams


def test_defaults_match_vllm_shape():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy


def test_stop_str_is_normalized_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(stop=["a", "xyz"]).max_stop_len == 3


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_valid_edges_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, logprobs=0, max_tokens=None)
    SamplingParams(top_p=1e-6, top_k=1, min_p=0.0, logprobs=20, max_tokens=1, min_tokens=1)
    SamplingParams(seed=0, temperature=2.0, n=4, stop_token_ids=[0])


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="7"), "seed"),
])
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
