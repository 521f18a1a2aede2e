"""IncrementalDetokenizer: streaming equals a full decode, UTF-8 safety, stop strings."""
from pathlib import Path

import pytest

from baton.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from baton.sampling_params import SamplingParams
from tests.tiny_models import train_tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld, naïve café",
    "日本語のテキスト and more 日本語",
    "emoji 🚀🔥 rocket fire 🚀🚀🔥",
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n",
    "mixed: é日🚀x🔥ö語 done",
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def _prompt(tok) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)


def _stream(tok, ids, params, step=1, flush=True):
    """Feed ids `step` at a time; return (deltas, detokenizer, stop_string)."""
    detok = IncrementalDetokenizer(tok, _prompt(tok), params)
    deltas, stop = [], None
    for i in range(0, len(ids), step):
        upd = detok.update(ids[i:i + step])
        assert isinstance(upd, DetokenizerUpdate)
        deltas.append(upd.text_delta)
        if upd.stop_string is not None:
            stop = upd.stop_string
            break
    if flush and stop is None:
        deltas.append(detok.flush())
    return deltas, detok, stop


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_equals_full_decode(tok, text, step):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    deltas, detok, _ = _stream(tok, ids, SamplingParams(), step=step)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    ids = tok.encode("café 🚀") + [tok.eos_token_id] + tok.encode(" after") + [1, 0]
    deltas, _, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is (not skip)


def test_text_is_held_only_until_the_character_completes(tok):
    ids = tok.encode("🚀")
    assert len(ids) > 1  # the rocket's 4 bytes span several tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = [detok.update([i]).text_delta for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


def test_decoding_window_stays_small(tok):
    """O(window) per token: decode never sees more than a few ids."""
    sizes = []

    class Spy:
        def decode(self, ids, skip_special_tokens):
            sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(MULTIBYTE_TEXTS) * 5)
    detok = IncrementalDetokenizer(Spy(), _prompt(tok), SamplingParams(stop=["zzz"]))
    text = "".join(detok.update([i]).text_delta for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 300 and max(sizes) <= 12


def test_undecodable_bytes_are_released_after_a_few_tokens(tok):
    lone_lead = tok.convert_tokens_to_ids("ð")  # byte 0xF0 alone: never completes
    ids = [lone_lead] + tok.encode(" hello world again and again")
    deltas, _, _ = _stream(tok, ids, SamplingParams())
    assert "".join(deltas) == tok.decode(ids)
    assert "".join(deltas[:-1]).startswith("\ufffd")  # streamed before the end


def _stop_case(tok, text, stops, include=False, step=1):
    ids = tok.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    return _stream(tok, ids, params, step=step)


@pytest.mark.parametrize("step", [1, 2])
def test_stop_string_across_tokens_is_cut_and_never_leaked(tok, step):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "n fox j"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # it spans several tokens
    deltas, detok, found = _stop_case(tok, text, [stop], step=step)
    expected = text[:text.index(stop)]
    assert found == stop and "".join(deltas) == expected == detok.output_text
    streamed = ""
    for d in deltas:  # every intermediate stream is a prefix of the final output
        streamed += d
        assert expected.startswith(streamed)
    with pytest.raises(RuntimeError):
        detok.update([ids[-1]])


def test_include_stop_str_in_output(tok):
    text = "Agents call tools, read results and call tools again."
    deltas, detok, found = _stop_case(tok, text, ["results"], include=True)
    assert found == "results"
    assert "".join(deltas) == detok.output_text == "Agents call tools, read results"


def test_earliest_stop_wins_whatever_the_order(tok):
    text = "Flight UA 123 from SFO to JFK departs at 10:45."
    for stops in (["JFK", "SFO"], ["SFO", "JFK"], ["departs", "UA 1"]):
        deltas, _, found = _stop_case(tok, text, stops)
        first = min(stops, key=lambda s: text.index(s) + len(s))
        assert found == first and "".join(deltas) == text[:text.index(first)]
    # The first to complete wins, even if a longer one started earlier.
    deltas, _, found = _stop_case(tok, text, ["SFO to JFK", "to"])
    assert found == "to" and "".join(deltas) == text[:text.index("to")]


def test_stop_prefix_is_held_then_released(tok):
    params = SamplingParams(stop=["lazy cat"])
    ids = tok.encode("over the lazy dog")
    detok = IncrementalDetokenizer(tok, [], params)
    streamed = ""
    for i in ids:
        upd = detok.update([i])
        assert upd.stop_string is None
        streamed += upd.text_delta
        assert not streamed.endswith(("lazy", "lazy ", "la"))  # never leaked while undecided
    assert streamed + detok.flush() == "over the lazy dog"


def test_flush_releases_a_held_stop_prefix(tok):
    ids = tok.encode("call tools ag")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["again"]))
    streamed = "".join(detok.update([i]).text_delta for i in ids)
    assert streamed == "call tools "
    assert detok.output_text == "call tools ag"
    assert detok.flush() == "ag" and detok.flush() == ""


@pytest.mark.parametrize("step", [1, 3, 100])
def test_stop_strings_ignored_before_min_tokens(tok, step):
    """vLLM's rule (v1/engine/detokenizer.py): a stop string stops the request only when it
    ends in the text of an output token past the first min_tokens, also when one update
    brings several tokens (speculative decoding)."""
    text = "ab ab ab ab"
    ids = tok.encode(text)
    n = len(tok.encode("ab ab"))  # token number n (1-based) completes the second "ab"
    assert ids[:n] == tok.encode("ab ab")
    for min_tokens, streamed in ((n - 1, "ab "), (n, "ab ab "), (n + 1, "ab ab ")):
        params = SamplingParams(stop=["ab"], min_tokens=min_tokens)
        deltas, _, found = _stream(tok, ids, params, step=step)
        assert found == "ab" and "".join(deltas) == streamed, min_tokens


def test_stop_on_the_first_token_and_multi_token_updates(tok):
    deltas, _, found = _stop_case(tok, "héllo wörld", ["h"])
    assert found == "h" and "".join(deltas) == ""
    deltas, _, found = _stop_case(tok, "héllo wörld 日本語", ["本"], step=5)
    assert found == "本" and "".join(deltas) == "héllo wörld 日"


SMOLLM2 = Path.home() / ".cache/baton/models/smollm2-135m"


@pytest.mark.slow
def test_real_smollm2_tokenizer_streams_exactly():
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"SmolLM2 tokenizer not cached at {SMOLLM2}")
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(SMOLLM2)
    extra = "Ünïcödé — “quotes” … 𝔘𝔫𝔦 👩‍👩‍👧 done"
    for text in MULTIBYTE_TEXTS + [extra]:
        ids = real.encode(text, add_special_tokens=False)
        deltas, _, _ = _stream(real, ids, SamplingParams())
        assert "".join(deltas) == real.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
    deltas, _, found = _stream(real, real.encode("Prefill computes the KV cache; decode"),
                               SamplingParams(stop=["KV c"]))
    assert found == "KV c" and "".join(deltas) == "Prefill computes the "


def test_a_character_cut_by_the_end_of_the_request_is_dropped(tok):
    """max_tokens can end a request inside a character: its missing bytes are not text, and
    the answer never ends in the U+FFFD a full decode shows (vLLM's detokenizers drop it)."""
    ids = tok.encode("café 🚀")
    rocket = tok.encode("🚀")
    assert len(rocket) > 1 and ids[-len(rocket):] == rocket
    for cut in range(1, len(rocket)):
        kept = ids[:len(ids) - len(rocket) + cut]
        assert tok.decode(kept) == "café \ufffd"
        deltas, detok, _ = _stream(tok, kept, SamplingParams())
        assert "".join(deltas) == detok.output_text == "café "
        assert deltas[-1] == ""  # flush() had nothing left to give


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ids_text_ends_the_output_only_when_asked(tiny_llama, include):
    """vLLM's rule: a token of stop_token_ids ends the request and its text is dropped,
    unless include_stop_str_in_output (it was dropped either way)."""
    from baton import LLM

    llm = LLM(str(tiny_llama), num_blocks=64, dtype="float32")
    prompt = [[5, 6, 7, 8]]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    stop_id = free.output_token_ids[3]  # the 4th token greedy decoding writes
    first = free.output_token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                              stop_token_ids=[stop_id],
                                              include_stop_str_in_output=include))[0]
    kept = free.output_token_ids[:first + 1]
    assert out.output_token_ids == kept and out.finish_reason == "stop"
    decode = llm.engine.tokenizer.decode
    # (random tokens: a character the output ends inside is dropped, as vLLM drops it)
    text = decode(kept if include else kept[:-1], skip_special_tokens=True)
    assert out.text == text.removesuffix("\ufffd")
    assert decode([stop_id], skip_special_tokens=True)  # a token with text, so it can differ


@pytest.mark.parametrize("skip", [True, False])
def test_eos_text_ends_the_output_with_include_stop_str_in_output(tiny_llama, skip):
    """vLLM's rule for eos as for stop_token_ids: its text ("<|im_end|>" unless special
    tokens are skipped) ends the output with include_stop_str_in_output; it never did."""
    from baton import LLM

    llm = LLM(str(tiny_llama), num_blocks=64, dtype="float32")
    eos = llm.engine.tokenizer.eos_token_id
    decode = llm.engine.tokenizer.decode
    for include in (False, True):
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(
            temperature=0, max_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=skip,
            include_stop_str_in_output=include))[0]
        assert out.output_token_ids == [eos] and out.finish_reason == "stop"
        assert out.text == (decode([eos], skip_special_tokens=skip) if include else "")
        assert out.text or skip or not include
