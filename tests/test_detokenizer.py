"""Incremental detokenization: equals a full decode, holds back broken characters and stop-string prefixes."""
from __future__ import annotations

import pytest

from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from backend.engine.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


def _stream(tokenizer, text, **params):
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params))
    deltas, stopped = [], None
    ids = tokenizer.encode(text)
    for i, t in enumerate(ids):
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stopped is not None or i == len(ids) - 1))
        if stopped:
            break
    return deltas, detok.text, stopped


def test_incremental_equals_full_decode_with_multibyte_text(tokenizer):
    text = " 你好，世界！Emoji 🙂🚀 and café déjà vu."
    deltas, full, _ = _stream(tokenizer, text)
    assert "".join(deltas) == full == tokenizer.decode(tokenizer.encode(text))
    assert all("\ufffd" not in d for d in deltas)
    # some characters span several byte-level tokens, so some steps must have emitted nothing
    assert "" in deltas


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    deltas, full, stopped = _stream(tokenizer, " alpha beta STOPWORD gamma", stop=["STOPWORD"])
    assert stopped == "STOPWORD"
    assert full == " alpha beta "
    assert "".join(deltas) == full
    assert not any("STOP" in d for d in deltas)


def test_stop_string_kept_when_asked(tokenizer):
    deltas, full, stopped = _stream(tokenizer, " one two three four", stop=[" three"], include_stop_str_in_output=True)
    assert stopped == " three" and full == " one two three" and "".join(deltas) == full


def test_a_stop_string_seen_before_checking_starts_is_never_matched_later(tokenizer):
    """min_tokens: text produced while stops may not count stays whole; a short stop string in it must not be
    found later because a longer stop string widens the look-back."""
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=[" b", " a much longer stop"]))
    ids = tokenizer.encode(" a b c d e")
    for t in ids[:3]:  # " a b" arrives while stops do not count
        assert detok.add_token(t, check_stop=False) is None
    for t in ids[3:]:
        assert detok.add_token(t) is None
    assert detok.text == tokenizer.decode(ids)
