"""Structured outputs: one grammar per request (llguidance), one token mask per constrained sample per step.

Grammar state is request-scoped, like KV blocks. A request's schema, regex, choice list or grammar is
compiled when the request is admitted, into a matcher that only its own samples hold (`Guide`; a
forked sample gets a copy); the matcher is dropped when its sample ends. A sample preempted by
recompute keeps its output, so it keeps its matcher as it is: recomputing the KV cache consumes no token. There is no cache of
grammars, compiled or not, across requests: a process-wide cache (vLLM's) would let one request's
compile time tell whether someone else used the same schema recently. What every request shares is
only the model's vocabulary as llguidance indexes it (`GrammarCompiler`), built once from the
tokenizer and never changed by a grammar.

A constraint with an `alternative` (a tool-call answer beside OpenAI's `response_format` under
`tool_choice: "auto"`) compiles to `start: alternative | constraint` (`either`), each part checked alone
first so that a refusal names the part's own field; two parts that compile alone but not as one (over the
limits together) are refused naming both, the alternative's field first (`tools together with response_format`).

A reasoning model's constraint starts after its `<think>` block where its answer has one to write: the
grammar compiled is then the free reasoning, `</think>`, and the request's grammar (`engine.reasoning_grammar`).

Compiling is bounded: the text by `MAX_STRUCTURED_SPEC_BYTES`, the work by llguidance's own fuel and
size limits (`_LIMITS`, counted in work, not time, so the same schema is refused on every machine),
and each step's mask computation by its per-step limits. Regexes cannot backtrack catastrophically:
llguidance's lexer (derivre) matches by regex derivatives, a lazily built automaton with no
backtracking, so a pattern like `(a+)+b` costs linear time in the text.

Refusals name the request field and a category; llguidance's own messages are never passed on,
since they quote the grammar. Its verbose errors and logging are turned off for the same reason.

Async scheduling: a constrained sample's mask for step N+1 depends on step N's token, which the host
has not read when step N+1 is launched. The engine therefore launches step N+1's forward first and
its pick after step N's picks are read and the matchers advanced (`LLMEngine.step`): the forward
still overlaps the host's work, and only steps with a constrained sample defer their pick. Such a step
sends its picks' row map and masks in an upload of their own: two host-to-device crossings instead of
one (still one download), the price of keeping the overlap where each crossing has a toll.

Why not one: the mask is computed by llguidance's matcher, on the host, from the tokens the sample
has output, and step N's token is on the device when step N+1's forward must be queued. Reading it
first would make such steps synchronous (the host's whole step of work no longer overlaps the
forward: milliseconds at large batches, against one ~0.3 ms toll); computing a mask per possible
token would cost a vocabulary's worth of matcher advances; and the grammar cannot move to the device,
since llguidance's parser is an Earley parser over a lexer, not a token automaton a kernel could
index. The second upload carries the row map and the masks: the settings live on the device
(`engine.sampling_tables`), written by a sample's first pick only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as FastTokenizer

from engine.errors import RequestRejected
from engine.reasoning_grammar import ThinkMarkers, reasoning_first, top_level
from engine.sampling_params import StructuredOutput
from engine.tokenizer import _forget_words as forget_words  # the tokenizer's own word-cache rules
from engine.tokenizer import _turn_off_word_cache as turn_off_word_cache

# Fuel for building the lexer (about 50k a millisecond) and the grammar's size in symbols: well
# above what real-world schemas need, low enough that no request holds a step for long.
_LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, max_lexer_states=50_000,
               step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)
# JSON with no free whitespace: a model cannot stall a structured answer with endless blank space. A Lark
# grammar's `%json{...}` parts take them as the schema's "x-guidance" (`JSON_OPTIONS_KEY`), which a JSON
# schema's own "x-guidance" sets over these defaults: only the node's own grammars carry one (a request's schema
# or grammar that does is refused by name, `enclave.schema_options`). A response format's JSON is compact, as
# OpenAI's structured outputs write it: no chat template renders an answer's JSON, so no one spacing is the model's
# own there (models write both compact and spaced JSON), and compact is the shortest. Tool calls are
# different: every template replays them with `tojson`'s spacing, which their grammars keep
# (`enclave.tool_grammar.CALL_JSON_OPTIONS`).
JSON_OPTIONS = {"whitespace_flexible": False}
JSON_OPTIONS_KEY = "x-guidance"
_ANY_OBJECT = '{"type": "object"}'
EITHER = "either"


class Guide:
    """One sample's grammar matcher; it lives and dies with the sample."""

    __slots__ = ("_matcher", "__weakref__")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fork(self) -> Guide:
        """A copy for another sample of the same request (samples fork before any output)."""
        return Guide(self._matcher.deep_copy())

    def advance(self, token: int) -> bool:
        """Consumes a picked token; False if the grammar does not allow it (never, when its mask applied)."""
        return self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the sample's output is whole."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def __repr__(self) -> str:
        return "Guide()"  # nothing of the grammar or the output


@dataclass(slots=True)
class MaskRequest:
    """One constrained pick: its sample's matcher, and the stop token ids allowed where the grammar accepts."""

    guide: Guide
    stop_token_ids: tuple[int, ...]


class GrammarCompiler:
    """Compiles requests' constraints against the model's vocabulary; holds nothing of any request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        added_tokens = FastTokenizer.from_str(tokenizer_json).get_added_tokens_decoder()
        self._tokenizer = _vocabulary(tokenizer_json, vocab_size, eos_token_ids, added_tokens)
        self._think = ThinkMarkers.of(added_tokens, self._tokenizer.tokenize_str)
        self._executor = llguidance.LLExecutor()
        self.words = (vocab_size + 31) // 32

    def compile(self, structured: StructuredOutput) -> Guide:
        """A fresh matcher for one request; raises RequestRejected naming the field."""
        grammar, whole = _grammar(structured), structured
        if structured.alternative is not None:  # each part is checked alone first, so a refusal names its field
            self._matcher(grammar, structured)
            alternative = _grammar(structured.alternative)
            self._matcher(alternative, structured.alternative)
            grammar, whole = either(alternative, grammar), _together(structured)
        matcher = self._matcher(grammar, whole)
        if structured.reasoning == "inside" or (structured.reasoning == "block" and not self._writes_block(matcher)):
            matcher = self._matcher(reasoning_first(grammar, structured.reasoning, self._think), whole)
        return Guide(matcher)

    def _matcher(self, grammar: str, structured: StructuredOutput) -> llguidance.LLMatcher:
        limits = llguidance.LLParserLimits(**_LIMITS)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise RequestRejected("invalid_structured_output", _refusal(structured, matcher.get_error()))
        return matcher

    def _writes_block(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether a constraint's answer may begin with `<think>`: it shapes the reasoning block itself."""
        opening = list(self._think.open_tokens)
        return bool(opening) and matcher.validate_tokens(opening) == len(opening)

    def masks(self, requests: list[MaskRequest]) -> torch.Tensor:
        """[requests, words] int32 bitmasks of the tokens each may pick next, filled in parallel on the host."""
        masks = torch.zeros((len(requests), self.words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(r.guide.matcher, k) for k, r in enumerate(requests)], masks.data_ptr(), self.words * 4, len(requests)
        )
        bits = masks.numpy().view(np.uint32)
        for k, request in enumerate(requests):
            # A stop token ends the output, so like EOS it may be picked only where the grammar accepts.
            accepting = request.stop_token_ids and request.guide.accepting
            for token in request.stop_token_ids:
                if accepting:
                    bits[k, token // 32] |= np.uint32(1 << (token % 32))
                else:
                    bits[k, token // 32] &= ~np.uint32(1 << (token % 32))
        return masks


def _vocabulary(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                added_tokens: dict[int, AddedToken]) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance indexes it, with the added tokens as the model writes them.

    llguidance, read from `tokenizer.json` alone, takes every added token shaped `<...>` for a special
    token, which only its `<[id]>` form in a grammar matches, yet tokenizes a grammar's text with the
    library, which reads `<think>`, `<tool_call>` (added, not special: Qwen's) and `<|im_end|>` in it
    as those tokens: the mask then offers the token and the matcher refuses it, so the sample aborts.
    Here each added token that is not special is its text, as the model uses it (a grammar's
    `<tool_call>` may be written as that one token), and a grammar's text never reads as a special one.
    """
    eos = eos_token_ids or None
    indexed = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    text_tokens = {token_id: token.content.encode() for token_id, token in added_tokens.items() if not token.special}
    tokens = [text_tokens.get(t) or indexed.decode_bytes([t]) for t in range(vocab_size)]
    special = [t for t in range(vocab_size) if t not in text_tokens and indexed.is_special_token(t)]
    source = _GrammarText(tokenizer_json, tokens, special, eos_token_ids[0] if eos_token_ids else indexed.eos_token,
                          indexed.greedy_tokenize)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), n_vocab=vocab_size, eos_token=eos)


class _GrammarText:
    """What llguidance's `TokenizerWrapper` reads: each token's bytes, the special ids, and the encoding of
    a grammar's fixed text, in which added tokens that are not special are matched and special ones never.

    An encoding whose tokens do not spell the text exactly (SentencePiece's word-start space before a
    fragment) is replaced by the vocabulary's greedy one: a forced token must be one the grammar accepts."""

    bos_token_id = None

    def __init__(self, tokenizer_json: str, tokens: list[bytes], special: list[int], eos_token_id: int,
                 greedy: Callable[[str], list[int]]) -> None:
        self.tokens, self.special_token_ids, self.eos_token_id = tokens, special, eos_token_id
        self._greedy = greedy
        self._library = FastTokenizer.from_str(tokenizer_json)
        self._library.encode_special_tokens = True
        turn_off_word_cache(self._library)

    def __call__(self, text: str) -> list[int]:
        # A grammar's text is a request's: its words must not stay in the library's cache.
        try:
            ids = self._library.encode(text, add_special_tokens=False).ids
        finally:
            forget_words(self._library)
        exact = b"".join(self.tokens[t] for t in ids if t < len(self.tokens)) == text.encode("utf-8", "surrogatepass")
        return ids if exact else self._greedy(text)


def _grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; raises RequestRejected naming the field."""
    try:
        if structured.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
        if structured.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_OPTIONS)
        if structured.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(structured.spec)
        if structured.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_grammar(structured))
        return llguidance.LLMatcher.grammar_from_lark(structured.spec)
    except RecursionError:
        raise RequestRejected("invalid_structured_output", _refusal(structured, "recursion limit")) from None
    except UnicodeError:  # JSON can carry lone surrogates, which are not text
        raise RequestRejected("invalid_structured_output", f"{structured.field} must be valid Unicode") from None
    except (ValueError, TypeError) as error:
        # llguidance's JSON reader has a depth limit: valid JSON nested too deep is over a limit, not invalid.
        over = "recursion" in str(error).lower()
        raise RequestRejected("invalid_structured_output",
                              _refusal(structured, "limit") if over else f"{structured.field} is not valid JSON") from None


def _together(structured: StructuredOutput) -> StructuredOutput:
    """What a refusal of a constraint and its alternative compiled as one names: both, the alternative first,
    so that its field is the refusal's `param`. Each compiled alone, so neither is the cause by itself; the
    alternative (the tools' calls beside a response format) is the part a user can most often cut down."""
    both = f"{structured.alternative.field} together with {structured.field}"
    return dataclasses.replace(structured, kind="grammar", field=both, alternative=None)


def either(first: str, second: str) -> str:
    """One grammar allowing what `first` or `second` allows (llguidance's JSON form or Lark text each): the two
    as sub-grammars (`@name`) of `start: @first | @second`, named `EITHER` so that a reasoning block may
    come before the whole (`reasoning_first`)."""
    grammars = []
    for name, grammar in (("either_first", first), ("either_second", second)):
        head, *others = top_level(grammar)["grammars"]
        grammars += [{**head, "name": name}, *others]  # renamed: the two heads may share a name (json_schema)
    outer = {"name": EITHER, "lark_grammar": "start: @either_first | @either_second\n"}
    return json.dumps({"grammars": [outer, *grammars]})


def _choice_grammar(structured: StructuredOutput) -> str:
    try:
        choices = json.loads(structured.spec)
    except (ValueError, RecursionError):
        choices = None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise RequestRejected("invalid_structured_output", f"{structured.field} must be a list of non-empty strings")
    # JSON string literals are Lark string literals (llguidance's own choice grammar writes them so).
    return "start: " + " | ".join(json.dumps(c) for c in choices)


# Categories of llguidance's errors, matched on its wording; anything else is "not valid".
_CATEGORIES = (
    (("limit", "fuel", "too large", "too many", "too big", "exceeded"), "is over this node's limits for compiling a grammar"),
    (("unimplemented", "unknown format", "not supported", "unsupported"), "uses a feature this node does not implement"),
)


def _refusal(structured: StructuredOutput, error: str) -> str:
    lowered = error.lower()
    for words, what in _CATEGORIES:
        if any(word in lowered for word in words):
            return f"{structured.field} {what}"
    return f"{structured.field} is not a valid {structured.kind.replace('_', ' ')}"
