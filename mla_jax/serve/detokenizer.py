"""Incremental detokenization and stop strings, for streaming text as tokens arrive.

`IncrementalDetokenizer` wraps the `tokenizers` library's `DecodeStream`: each new token yields the text it adds
(nothing while a multi-byte character is incomplete), in time independent of the length so far, instead of
decoding the whole output again at every token. It starts from the last few prompt tokens as context, so a
tokenizer whose decoding depends on the previous token (SentencePiece's leading-space marker) decodes the first
output token as it would mid-text.

`TextOutput` adds stop strings to that: it keeps the text so far, cuts it at the first stop string (which is not
part of the output unless asked for), and releases text for streaming only when no stop string can still begin
in it: the longest tail of the unsent text that is a prefix of some stop string is held back until the next
token decides it, or until the end. The streamed pieces, concatenated, are always the final text.
"""

from __future__ import annotations

from typing import Sequence

# Prompt tokens given to DecodeStream as context (enough for any tokenizer's decoding of the first output token).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of a growing token sequence, one piece per token (`add`), through `tokenizers.decoders.DecodeStream`."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        ctx = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]] if prompt_ids else None
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text token `token_id` completes ("" while a character is still incomplete, or for a skipped
        special token)."""
        return self._stream.step(self.tokenizer, int(token_id)) or ""


def _held_back(text: str, start: int, stops: Sequence[str]) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of one of `stops` (may still become one)."""
    longest = max((len(s) for s in stops), default=0)
    for k in range(min(longest - 1, len(text) - start), 0, -1):
        tail = text[len(text) - k :]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class TextOutput:
    """One choice's output text: incremental detokenization, stop strings, streaming hold-back."""

    def __init__(
        self,
        tokenizer,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # the output so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` already released by `delta`
        self.stop_reason: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, token_id: int) -> bool:
        """Appends a token's text; True when it completes a stop string (the text is then final)."""
        if self.stopped:
            return True
        piece = self.detok.add(token_id)
        if not piece:
            return False
        before = len(self.text)
        self.text += piece
        if self.stop:
            hit = None
            for s in self.stop:  # the earliest stop string wins; it may have started in earlier pieces
                i = self.text.find(s, max(0, before - len(s) + 1))
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
                self.stop_reason = s
                return True
        return False

    def delta(self, final: bool = False) -> str:
        """Text not yet released that no stop string can still claim (everything once `final` or stopped)."""
        end = len(self.text)
        if not (final or self.stopped) and self.stop:
            end -= _held_back(self.text, self.sent, self.stop)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
