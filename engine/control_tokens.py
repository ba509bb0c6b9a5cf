"""Text a user wrote stays text: a control token spelled in a message or a prompt is not that token.

A document pasted into a chat may spell `<|im_end|>`, `<|eot_id|>` or `[INST]`. Encoded as a whole, the
rendered chat would turn that text into the control token and end the user's turn inside their own
message. As transformers' `apply_chat_template(..., sanitize_control_tokens=True)` does, the strings of
the request are marked before the template renders them: each control token they spell is wrapped in two
private-use characters (and those characters are first removed from the text, so none can be forged).
The rendered text is then cut at the marks: the marked tokens are encoded as plain text, everything else
(the template's own tokens among it) as usual. Text that spells no control token is encoded exactly as
before, in one piece.

Control tokens are the tokenizer's special tokens and the added tokens the template writes itself (Qwen's
`<tool_call>`, `<think>`), whitespace ones excepted, or the list `chat_control_tokens` in
tokenizer_config.json names (transformers' rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARK_START, MARK_END = "\U000f0000", "\U000f0001"


@dataclass(frozen=True, slots=True)
class ControlTokens:
    """The control tokens of one template, and how to find them in a request's strings and in the rendering."""

    tokens: re.Pattern  # any control token, the longest first
    marked: re.Pattern  # a marked added token (its text is group 1), or a lone mark

    @classmethod
    def of(cls, added: dict[str, bool], template_text: str, configured: list[str] | None) -> ControlTokens:
        """`added`: every added token's text and whether it is special; `template_text`: the template's literals."""
        if configured is not None:
            control = [token for token, special in added.items() if special or token in configured]
        else:
            control = [token for token, special in added.items()
                       if special or (token in template_text and not token.isspace())]
        tokens = _alternatives(control)
        marked = re.compile(f"{MARK_START}({_alternatives(list(added)).pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
        return cls(tokens, marked)

    def mark(self, data: object) -> object:
        """`data` (a string, or lists and dicts of them) with every control token in its strings marked."""
        if isinstance(data, str):
            text = data.replace(MARK_START, "").replace(MARK_END, "")
            return self.tokens.sub(lambda found: MARK_START + found.group(0) + MARK_END, text)
        if isinstance(data, dict):
            return {key: self.mark(value) for key, value in data.items()}  # keys are the schema's, not text
        if isinstance(data, (list, tuple)):
            return [self.mark(value) for value in data]
        return data

    def pieces(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered text cut at the marks: (piece, whether it is a marked token to encode as text), the
        first piece always there (it may be empty).

        A template's string methods can separate a token from its marks; a lone mark is dropped, but it
        still cuts the text, so the text on either side cannot join into a control token.
        """
        parts = self.marked.split(rendered)  # [text, token, text, token, ..., text], None for a lone mark
        return [(parts[0], False)] + [(part, index % 2 == 1) for index, part in enumerate(parts) if part and index]


def _alternatives(tokens: list[str]) -> re.Pattern:
    longest_first = sorted(tokens, key=len, reverse=True)  # a token wins over the tokens inside it
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): matches nothing
