"""Speculative decoding's worker flags (baton/worker/flags.py → SpeculativeConfig)."""
import pytest

from decode_service.config import parse_args as decode_parse


def test_off_by_default_and_on_when_asked():
    assert decode_parse([]).engine.speculative.method is None
    spec = decode_parse(["--speculative-method", "ngram", "--num-speculative-tokens", "3",
                         "--speculative-min-match-tokens", "4"]).engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.min_match_tokens) == ("ngram", 3, 4)
    assert spec.synthetic_acceptance == ()


def test_the_benchmark_mode_is_refused_unless_speculation_is_named(capsys):
    with pytest.raises(SystemExit):
        decode_parse(["--spec-benchmark-synthetic-acceptance", "0.7"])
    assert "needs a speculative method" in capsys.readouterr().err
    spec = decode_parse(["--speculative-method", "suffix",
                         "--spec-benchmark-synthetic-acceptance", "0.7"]).engine.speculative
    assert spec.acceptance_rates()[:2] == pytest.approx((0.7, 0.49))
    with pytest.raises(SystemExit):
        decode_parse(["--speculative-method", "suffix",
                      "--spec-benchmark-synthetic-acceptance", "lots"])
    with pytest.raises(SystemExit):
        decode_parse(["--speculative-method", "suffix",
                      "--spec-benchmark-synthetic-acceptance", "0.5,0.9"])
    assert "non-increasing" in capsys.readouterr().err
