"""Synthetic token ids for hash ids, chat token counting, and the theoretical prefix hit."""
import numpy as np
import pytest

from baton.bench.prepare import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, Preparer, lcp, theoretical_hits
from baton.bench.tokens import BlockSynth, TokenCounter
from baton.bench.workload import BlockScope, Child, Session, Turn

A = np.asarray


def test_block_synth_equal_ids_share_prefixes():
    synth = BlockSynth(None, block_tokens=8)
    x = synth.word_indices("ns", (1, 2, 3), 24)
    y = synth.word_indices("ns", (1, 2, 4), 24)
    z = synth.word_indices("ns", (5, 2, 3), 24)
    assert len(x) == 24
    assert (x[:16] == y[:16]).all() and not (x[16:] == y[16:]).all()
    assert not (x[:8] == z[:8]).all()
    # a partial last block is a prefix of the full block
    assert (synth.word_indices("ns", (1, 2, 3), 20) == x[:20]).all()
    # another namespace (session-local ids, another run) gives other tokens
    assert not (synth.word_indices("other", (1, 2, 3), 24) == x).all()
    # deterministic across instances
    assert (BlockSynth(None, 8).word_indices("ns", (1, 2, 3), 24) == x).all()


@pytest.fixture(scope="module")
def tiny_tok():
    """The tiny test BPE with a ChatML template (no model needed)."""
    from tests.tiny_models import train_tokenizer

    return train_tokenizer()


@pytest.fixture(scope="module")
def word_tok():
    """A byte-level BPE that knows ~200 whole words (" the", " water", ...) as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from baton.bench.tokens import _WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(_WORDS)] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_block_synth_word_tokens_round_trip(word_tok):
    synth = BlockSynth(word_tok, block_tokens=16)
    assert synth.has_token_ids
    ids = synth.ids_for("ns", (3, 4), 32)
    text = synth.text_for("ns", (3, 4), 32)
    assert word_tok.decode(ids) == text
    assert word_tok(text)["input_ids"] == ids  # the text re-tokenizes to the same ids


def test_block_synth_token_ids_from_tokenizer(tiny_tok):
    tok = tiny_tok
    synth = BlockSynth(tok, block_tokens=4)
    text = synth.text_for("ns", (1, 2), 8)
    assert text.startswith(" ") and len(text.split()) == 8
    if synth.has_token_ids:  # the tiny BPE may have too few whole words
        ids = synth.ids_for("ns", (1, 2), 8)
        assert tok.decode(ids) == text


def test_lcp_and_theoretical_hits():
    assert lcp(A([1, 2, 3]), A([1, 2, 4, 5])) == 2
    assert lcp(A([1, 2]), A([1, 2, 3])) == 2
    assert lcp(A([]), A([1])) == 0
    prompts = [A([1, 2, 3, 4]), A([1, 2, 3, 4, 5, 6]), A([1, 2, 9]), A([1, 2, 3, 4, 5, 6])]
    # first: nothing earlier; second: all of the first; third: shares 2 with either;
    # fourth: identical to the second, capped at len - 1 (the last token is always computed)
    assert theoretical_hits(prompts) == [0, 4, 2, 5]


def test_theoretical_hit_is_max_over_earlier_prompts():
    prompts = [A([7, 7, 7]), A([1, 2, 3, 4, 5]), A([7, 7, 7, 7]), A([1, 2, 3, 4, 9])]
    assert theoretical_hits(prompts) == [0, 0, 3, 4]


def _chat_session():
    msgs = [{"role": "system", "content": "You are an airline agent. " * 10},
            {"role": "user", "content": "Book me a flight."},
            {"role": "assistant", "content": "Which date?"},
            {"role": "user", "content": "May 20."}]
    return Session("chat", (Turn(max_tokens=5, messages=tuple(msgs[:2])),
                            Turn(max_tokens=5, messages=tuple(msgs), arrival_s=1.0)))


def test_chat_prompts_are_additive_and_match_full_tokenization(tiny_tok):
    counter = TokenCounter(tiny_tok)
    msgs = list(_chat_session().turns[1].messages)
    first, second = counter.chat_prompts(msgs, [2, 4])
    full = counter.encode(counter._render(msgs, True))
    assert second.tolist() == full
    assert second[: len(first)].tolist() == first.tolist()


def test_prepare_chat_session_marks_and_counts():
    prep = Preparer(TokenCounter(None), run_salt="run1")
    ps = prep.prepare(_chat_session(), tree_index=0)
    t0, t1 = ps.turns
    assert t0.endpoint == CHAT_ENDPOINT and t0.body["max_tokens"] == 5
    assert t0.body["messages"][1]["content"].startswith("[rid:")
    assert t0.body["messages"][1]["content"] == t1.body["messages"][1]["content"]
    assert t0.theo_hit == 0
    # turn 1's prompt starts with all of turn 0's prompt (ChatML + generation prompt)
    assert t0.prompt_tokens - 1 <= t1.theo_hit <= t0.prompt_tokens  # chars/4 piece edge
    other = prep.prepare(_chat_session(), tree_index=1)
    assert other.session_id != ps.session_id
    assert other.turns[0].body["messages"][1]["content"] != t0.body["messages"][1]["content"]
    # a max context drops the turns that do not fit
    short = Preparer(TokenCounter(None), "run1", max_context_tokens=t0.prompt_tokens)
    assert len(short.prepare(_chat_session(), 0).turns) == 1


def test_prepare_block_tree_theoretical():
    parent = (Turn(max_tokens=3, block_ids=(1, 2), num_tokens=16),
              Turn(max_tokens=3, block_ids=(1, 2, 3), num_tokens=20, arrival_s=2.0))
    kid = Session("kid", (Turn(max_tokens=2, block_ids=(1, 9), num_tokens=16, arrival_s=1.0),),
                  block_tokens=8, block_scope=BlockScope.TREE)
    tree = Session("p", parent, children=(Child(kid, after_turn=0, join_turn=1),),
                   block_tokens=8, block_scope=BlockScope.TREE)
    prep = Preparer(TokenCounter(None), "salt", prompt_format="text")
    ps = prep.prepare(tree, 0)
    (_, kp), = ps.children
    assert ps.turns[0].endpoint == COMPLETIONS_ENDPOINT
    assert isinstance(ps.turns[0].body["prompt"], str)
    assert [t.prompt_tokens for t in ps.all_turns()] == [16, 20, 16]
    # order by arrival: p0 (0), kid0 (block 1 shared: 8), p1 (2 blocks of p0: 16)
    assert [ps.turns[0].theo_hit, kp.turns[0].theo_hit, ps.turns[1].theo_hit] == [0, 8, 16]
    # tree-local ids: another replay gets other tokens; global ids would be shared
    again = prep.prepare(tree, 1)
    assert again.turns[0].body["prompt"] != ps.turns[0].body["prompt"]


def test_prepare_global_scope_shares_across_sessions():
    s = Session("g", (Turn(max_tokens=1, block_ids=(1, 2), num_tokens=16),), block_tokens=8)
    prep = Preparer(TokenCounter(None), "salt", prompt_format="text")
    assert prep.prepare(s, 0).turns[0].body == prep.prepare(s, 1).turns[0].body


@pytest.mark.parametrize("fmt", ["tokens", "text"])
def test_prepare_block_prompt_format(fmt, word_tok):
    counter = TokenCounter(word_tok)
    s = Session("g", (Turn(max_tokens=1, block_ids=(1, 2), num_tokens=12),), block_tokens=8)
    body = Preparer(counter, "salt", prompt_format=fmt).prepare(s, 0).turns[0].body
    if fmt == "tokens":
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 12
    else:
        assert isinstance(body["prompt"], str) and len(word_tok(body["prompt"])["input_ids"]) == 12
