# >>> ch16 file: text in and out, on the HTTP side
"""The HTTP side's chat: messages to a prompt through the checkpoint's chat template (transformers).
Token deltas become text deltas in minioverlap/text.py's TextStream, which the engine's stop check shares.
"""

from __future__ import annotations

from pathlib import Path

import jinja2


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
