"""A chat answer's text split into its parts: the model's reasoning, its content, and its tool calls.

Reasoning models (Qwen3, the DeepSeek-R1 distills) think in a `<think>…</think>` block before they
answer; their template says so (it handles `</think>` in the conversation). The block comes back as
`reasoning_content` (`message.reasoning_content`, `delta.reasoning_content`), as vLLM's reasoning
parsers return it, and only the text after it is content, read for tool calls. Where the prompt
itself ends inside an open `<think>` (DeepSeek-R1's newer templates), the answer starts as
reasoning and `</think>` alone ends it; an answer that never closes its block is all reasoning. A
constrained answer reasons first too (`reasoning_first`: the constraint applies after `</think>`). A
reasoning trace is text of the answer like any other: never logged, audited or kept.

As for tool calls, one parser per sample reads the text as it streams and a whole answer is the
same parser fed at once, so a streamed answer's parts add up to the whole one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import THINK_CLOSE, THINK_OPEN, SamplingParams
from enclave.tool_calls import ChoiceCalls, Parsed, safe_end


# The prompt's last tokens that `reasoning_place` reads: enough to spell `</think>\n\n` byte by byte, in a
# vocabulary where the markers are no tokens of their own.
TAIL_TOKENS = 16


def reasons(template: str | None) -> bool:
    """Whether a chat template is a reasoning model's: it handles the end of a `<think>` block."""
    return bool(template) and THINK_CLOSE in template


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt ends inside a `<think>` block (so the answer starts as reasoning)."""
    return reasoning_place(prompt_tail) == "inside"


def reasoning_place(prompt_tail: str) -> str:
    """Where a reasoning model's block stands as its prompt ends (`engine.sampling_params.REASONING_PLACES`):
    "inside" one the prompt opened, "none" where the prompt closed one itself (Qwen3's `enable_thinking`
    false renders an empty block: the answer reasons no more), else "block": the answer opens one."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_OPEN):
        return "inside"
    return "none" if tail.endswith(THINK_CLOSE) else "block"


def reasoning_first(params: SamplingParams, place: str) -> SamplingParams:
    """A reasoning model's constraint applied after its reasoning, which is free text up to `</think>`
    (`engine.reasoning_grammar`), as vLLM does: the answer's content is still exactly what it allows."""
    if params.structured is None or place == "none":
        return params
    return dataclasses.replace(params, structured=dataclasses.replace(params.structured, reasoning=place))


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""

    def __repr__(self) -> str:
        return f"Split({len(self.reasoning)} + {len(self.content)} characters)"


class ReasoningParser:
    """Splits one sample's text into reasoning and content, piece by piece."""

    def __init__(self, inside: bool) -> None:
        # "start": a block may still open; "inside": reasoning; "after": just closed; "content": the rest.
        self._state = "inside" if inside else "start"
        self._held = ""

    def feed(self, text: str) -> Split:
        self._held += text
        split = Split()
        while self._advance(split):
            pass
        return split

    def finish(self) -> Split:
        held, self._held = self._held, ""
        if self._state == "inside":
            return Split(reasoning=held)
        return Split(content="" if self._state == "after" else held)

    def _advance(self, split: Split) -> bool:
        """Gives out what the held text settles; True while there may be more to settle."""
        body = self._held.lstrip()
        if self._state == "start":
            if not body or (THINK_OPEN.startswith(body) and body != THINK_OPEN):
                return False  # nothing tells yet
            if body.startswith(THINK_OPEN):
                self._held, self._state = body[len(THINK_OPEN):], "inside"
            else:
                self._state = "content"
            return True
        if self._state == "inside":
            end = self._held.find(THINK_CLOSE)
            settled = safe_end(self._held, THINK_CLOSE) if end < 0 else end
            split.reasoning += self._held[:settled]
            self._held = self._held[settled:] if end < 0 else self._held[end + len(THINK_CLOSE):]
            self._state = self._state if end < 0 else "after"
            return end >= 0
        if self._state == "after":  # the whitespace between the block and the answer is layout
            if not body:
                return False
            self._held, self._state = body, "content"
        split.content += self._held
        self._held = ""
        return False


@dataclass(slots=True)
class ChoiceReader:
    """One choice's reading: its reasoning (when the model reasons), then its tool calls (when read)."""

    reasoning: ReasoningParser | None = None
    calls: ChoiceCalls | None = None

    def read(self, text: str, last: bool) -> tuple[str, Parsed]:
        """The reasoning and the parsed content `text` settles (all that is left when `last`)."""
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if last:
                rest = self.reasoning.finish()
                split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
            reasoning, text = split.reasoning, split.content
        parsed = self.calls.read(text, last) if self.calls is not None else Parsed(text)
        return reasoning, parsed

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.calls is None else self.calls.finish_reason(reason)
