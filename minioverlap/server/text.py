# >>> ch16 file: text in and out, on the HTTP side
"""The HTTP side's text: chat messages to a prompt through the checkpoint's chat template (transformers),
token deltas to text deltas, and the text cut at a stop string.

Decoding only the new tokens is wrong: a character may span two tokens (bytes of one UTF-8 character),
and a byte-level tokenizer decodes a token differently at the start of a text. Decoding every token at
every step is right but grows with the output. The Detokenizer decodes a short window, as vLLM does: the
text of the tokens from `prefix` on, less the text of those from `prefix` to `read` (already sent); it
holds back a delta that ends in an unfinished character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jinja2


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0                  # the window starts here
        self.read = 0                    # the text of ids[:read] has been sent

    def add(self, new_ids: list[int], last: bool = False) -> str:
        """The text the new tokens add; with `last`, everything not sent yet."""
        self.ids += new_ids
        sent = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(sent) or (text.endswith("\ufffd") and not last):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent):]


class ChatTemplate:
    """The checkpoint's chat template, rendered by transformers: AutoTokenizer reads it from
    tokenizer_config.json (or chat_template.jinja), and apply_chat_template renders it in a sandboxed
    Jinja environment with the tokenizer's special tokens, as every transformers user gets it."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer        # a few seconds to import: only a server pays it
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError):                  # no tokenizer transformers can build: no chat
            self.tokenizer = None
        self.template = self.tokenizer.chat_template if self.tokenizer is not None else None

    def render(self, messages: list[dict]) -> str:
        """The prompt, ending with the assistant's turn opened; ValueError if the template refuses the messages."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as err:            # the template's own raise_exception, or a broken template
            raise ValueError(f"the chat template refused the messages: {err}") from None


class StopText:
    """Cuts a stream of text deltas at the first stop string, which is not sent (OpenAI's rule). The tail
    that could be the start of a stop string is held back until the next delta settles it."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def add(self, delta: str, last: bool = False) -> str:
        """The text to send now; after it, `stopped` says whether a stop string ended the text."""
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        text, self.held = self.held + delta, ""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if not last:
            keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text, self.held = text[:len(text) - keep], text[len(text) - keep:]
        return text
