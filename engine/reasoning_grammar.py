"""A reasoning model's constrained answer: free reasoning up to `</think>`, then the request's own constraint.

Reasoning models (Qwen3, the DeepSeek-R1 distills) write a `<think>…</think>` block before they answer.
A constraint enforced from the first token would leave them no room to reason, so where the answer has a
block to write (`StructuredOutput.reasoning`), the grammar the engine enforces is: the block (opened by
the answer, or already by the prompt), at most a blank line, then the request's grammar unchanged, as
vLLM starts its grammar at the reasoning's end. What follows `</think>` is exactly what the constraint
allows, so the content is read for tool calls and parsed as JSON as it is without reasoning.

The reasoning is free text, bounded like any answer by `max_tokens` and the context: a sample cut short
while it thinks ends with finish reason "length". Stop and end-of-text tokens stay refused until the
constraint accepts, as without reasoning. The request's grammar is a sub-grammar (llguidance's `@name`
reference), so any constraint (a JSON schema, a regex, choices, a Lark grammar) nests the same way.

A constraint that may itself begin with `<think>` writes the block its own way (a regex that shapes the
reasoning, a grammar written for a reasoning model): it applies from the first token, as it was given.

A vocabulary may hold `<think>` and `</think>` as special tokens, which a grammar names by id (its text
never reads as a special token, `engine.structured`), or as text: Qwen's are added tokens that are not
special, and then the block ends at the first `</think>`, written as that one token or as pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import AddedToken

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER = "answer"  # the name the request's own grammar goes by inside the combined one
# Qwen3 and the R1 distills put a blank line between their block and their answer: allowed, and bounded so
# that a model cannot stall there (the JSON grammars allow no free whitespace for the same reason).
_LAYOUT = '"\\n"{0,2}'
# Text up to the first `</think>`, which ends it (lazy: the shortest match).
_TEXT_REASONING = 'reasoning[lazy]: /(?s:.*)<\\/think>/'
# Text holding no `</think>`, then the special token: text that spells the marker would end the reasoning
# the answer's reader sees (`enclave.answer_parts`) but not the grammar's.
_SPECIAL_REASONING = 'reasoning: REASONING {close}\nREASONING: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """How a grammar writes the block in one vocabulary (Lark): its opening, and its text through the close;
    and the tokens of the opening, by which a constraint that writes the block itself is told."""

    open: str
    reasoning: str
    open_tokens: tuple[int, ...]

    @classmethod
    def of(cls, added_tokens: dict[int, AddedToken], tokenize: Callable[[str], list[int]]) -> ThinkMarkers:
        special = {token.content: token_id for token_id, token in added_tokens.items() if token.special}
        if THINK_OPEN in special:
            opening, open_tokens = f"<[{special[THINK_OPEN]}]>", (special[THINK_OPEN],)
        else:
            opening, open_tokens = json.dumps(THINK_OPEN), tuple(tokenize(THINK_OPEN))
        close = f"<[{special[THINK_CLOSE]}]>" if THINK_CLOSE in special else None
        return cls(opening, _TEXT_REASONING if close is None else _SPECIAL_REASONING.format(close=close), open_tokens)


def reasoning_first(grammar: str, place: str, markers: ThinkMarkers) -> str:
    """`grammar` (llguidance's JSON form or Lark text) after the reasoning block; `place` is "block" (the
    answer opens it) or "inside" (the prompt opened it)."""
    top = top_level(grammar)
    first, *others = top["grammars"]
    name = first.get("name") if isinstance(first.get("name"), str) and _NAME.fullmatch(first["name"]) else ANSWER
    opening = markers.open + " " if place == "block" else ""
    outer = f"start: {opening}reasoning {_LAYOUT} @{name}\n{markers.reasoning}\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": outer}, {**first, "name": name}, *others]})


def top_level(grammar: str) -> dict:
    """The grammar in llguidance's JSON form (`{"grammars": [...]}`), which Lark text is wrapped into."""
    if grammar.lstrip().startswith("{"):  # as llguidance tells its JSON form from Lark
        try:
            top = json.loads(grammar)
        except (ValueError, RecursionError):
            top = None
        grammars = top.get("grammars") if isinstance(top, dict) else None
        if isinstance(grammars, list) and grammars and all(isinstance(g, dict) for g in grammars):
            return top
    # Lark text, or JSON that is no grammar: llguidance compiles it as Lark and refuses what is not.
    return {"grammars": [{"lark_grammar": grammar}]}
