# >>> ch16 file: tokens to text as they come, and where a stop string ends it
"""A request's output as text, decoded as its tokens arrive, and the stop strings found in it.

Decoding only the newest token is wrong: a byte-level BPE token may hold part of a UTF-8 character (the
tiny model spells 日 in three tokens), and a token's text can depend on what came before it. Decoding
the whole output after every token is right but grows with the output. tokenizers' DecodeStream does
what vLLM's and SGLang's detokenizers do by hand: it decodes a short window of the last tokens, and
gives a token's text only once its characters are complete (None until then).

One search serves everyone: the scheduler (Req.check_stop) finds a stop string in the text of the
tokens received, and ends the request on the token that completed it; LLM.generate cuts its text before
it; a server streams TextStream.add's deltas, which never hold a stop string or a part of one.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


def find_stop(text: str, stop: tuple[str, ...], start: int = 0, floor: int = 0) -> int | None:
    """Where the first stop string in text[start:] begins (the smallest index of any), or None. With
    min_tokens, only a stop string that ends past `floor` characters counts (TextStream.floor)."""
    found = [i for s in stop if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
    return min(found, default=None)


class TextStream:
    """One request's text, decoded token by token (DecodeStream, special tokens skipped unless
    skip_special_tokens is False), searched for its stop strings as it grows. Only a request with stop
    strings needs one in the scheduler. A checkpoint without a tokenizer (tokenizer None) takes token ids
    and gives no text. With min_tokens, a stop string counts only if it ends in the text of the
    min_tokens-th token or a later one (as vLLM checks none before): one earlier stays in the text."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self.tokenizer, self.stop, self.min_tokens = tokenizer, tuple(stop), min_tokens
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.hold = max(map(len, self.stop), default=1) - 1   # a stop string's start can lie this far back
        self.text = ""                   # the text of the tokens decoded so far
        self.decoded = 0                 # how many tokens that is
        self.end: int | None = None      # where the first stop string begins, once one is in the text
        self.sent = 0                    # characters given out by add
        self.floor = 0                   # a stop string must end past this: the text before the min_tokens-th token

    def decode(self, ids: list[int]) -> None:
        """Decode more tokens. After each piece of text, search the part a new stop string can be in:
        it ends in the new piece, so it starts at most `hold` characters before it."""
        for token in ids:
            piece = (self.decoder.step(self.tokenizer, token) or "") if self.tokenizer else ""   # no tokenizer: no text
            start = max(len(self.text) - self.hold, 0)
            self.text += piece
            self.decoded += 1
            if self.decoded < self.min_tokens:
                self.floor = len(self.text)
            elif piece and self.end is None:
                self.end = find_stop(self.text, self.stop, start, self.floor)

    def holds_stop(self, output_ids: list[int]) -> bool:
        """output_ids: all the request's tokens so far; those not decoded yet are decoded. True once the
        text holds a stop string: the newest token completed one (or an earlier token, already)."""
        self.decode(output_ids[self.decoded:])
        return self.end is not None

    def add(self, ids: list[int], finished: bool = False) -> str:
        """The text that `ids`, the next tokens, let go out: up to the first stop string, never into it;
        while unfinished, without the last `hold` characters (they may be the start of a stop string the
        next token completes). `finished`: the rest, up to the stop string if there is one."""
        self.decode(ids)
        if self.end is not None:
            end = self.end
        else:
            end = len(self.text) if finished else max(len(self.text) - self.hold, 0)
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta
