"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of tokens (vLLM's prefix/read offsets): a token's
text is only released once decoding no longer ends in U+FFFD, so a multi-byte character
split across tokens (Chinese, emoji) is never emitted half-done. While streaming, the last
len(longest stop string) - 1 characters are held back, since they may begin a stop string.
"""
from __future__ import annotations

# Prompt tokens decoded in front of the output, so the first output token gets its
# leading-space handling from its real context.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = 0 if self.include_stop or not self.stop else max(len(s) for s in self.stop) - 1
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output so far
        self.emitted = 0  # characters of self.text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one output token; returns the stop string if the text now contains one (text is cut there).

        With check_stop False (the output is not yet longer than min_tokens) stop strings are not looked for,
        and the text stays whole: a later check only finds a stop string that ends in text new since then.
        """
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an unfinished character: wait for the next token
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += new_text
        if not check_stop:
            return None
        # each stop string is looked for where it could end in the new text (as vLLM does)
        found = ((self.text.find(stop, max(0, before - len(stop) + 1)), stop) for stop in self.stop)
        matches = [(at, stop) for at, stop in found if at != -1]
        if not matches:
            return None
        at, stop = min(matches)  # the earliest stop string wins
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, a possible stop-string start is kept back."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
