# >>> ch16 file: text in and out, on the HTTP side
"""The HTTP side's text: chat messages to a prompt through the checkpoint's chat template, and token
deltas to text deltas.

Decoding only the new tokens is wrong: a character may span two tokens (bytes of one UTF-8 character),
and a byte-level tokenizer decodes a token differently at the start of a text. Decoding every token at
every step is right but grows with the output. The Detokenizer decodes a short window, as vLLM does: the
text of the tokens from `prefix` on, less the text of those from `prefix` to `read` (already sent); it
holds back a delta that ends in an unfinished character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
    """The checkpoint's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja),
    rendered as transformers renders it: a sandboxed Jinja environment, `add_generation_prompt`."""

    def __init__(self, model_dir: Path) -> None:
        self.source = read_template(model_dir)
        self.template = None
        if self.source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self.template = env.from_string(self.source)
        self.special = special_tokens(model_dir)

    def render(self, messages: list[dict]) -> str:
        """The prompt; ValueError if the template refuses the messages."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from None


def read_template(model_dir: Path) -> str | None:
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):               # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def special_tokens(model_dir: Path) -> dict[str, str]:
    """bos_token and eos_token as text, for templates that write them."""
    config = model_dir / "tokenizer_config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    tokens = {name: raw.get(name) for name in ("bos_token", "eos_token")}
    return {name: (t.get("content") if isinstance(t, dict) else t) or "" for name, t in tokens.items()}


def raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
