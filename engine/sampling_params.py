"""Per-request sampling settings, validated before a request is admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import RequestRejected

MAX_SAMPLES = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_LENGTH = 256
# Below this the scaled logits can overflow fp32 (at about 1e-37 they do); the distribution has
# collapsed onto its most likely token long before, so such temperatures are greedy.
MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's own limit on logit_bias
# A schema, regex or grammar is compiled for each request (nothing is cached across requests): this
# bounds the text; `engine.structured` bounds the compile's work.
MAX_STRUCTURED_SPEC_BYTES = 64 * 1024
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Where a reasoning model's `<think>` block stands when its constrained answer begins (`engine.reasoning_grammar`):
# no block ("none": the constraint from the first token), one the answer writes first ("block"), or one the
# prompt opened, which the answer closes first ("inside").
REASONING_PLACES = ("none", "block", "inside")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text, compiled per request by `engine.structured`.

    `spec` is the JSON schema as JSON text (json_schema), the regex (regex), the choices as a JSON
    list of strings (choice), a Lark grammar (grammar), or "" (json_object: any JSON object).
    `field` is the request field it came from, which refusals name (never its content). `reasoning`
    (one of `REASONING_PLACES`): whether free reasoning up to `</think>` comes before the constraint.
    `alternative`: what the output may be instead (`start: alternative | this`), as a tool-call answer
    beside OpenAI's `response_format` under `tool_choice: "auto"`; it has no reasoning or alternative
    of its own.
    """

    kind: str
    spec: str = ""
    field: str = "response_format"
    reasoning: str = "none"
    alternative: StructuredOutput | None = None

    def problem(self) -> str | None:
        """Why this constraint cannot be served as given, naming its field; None when it can."""
        if self.kind not in STRUCTURED_KINDS:
            return f"{self.field}: the kind of constraint must be one of {', '.join(STRUCTURED_KINDS)}"
        if not isinstance(self.spec, str):
            return f"{self.field} must be text"
        if len(self.spec.encode("utf-8", "surrogatepass")) > MAX_STRUCTURED_SPEC_BYTES:
            return f"{self.field} is over {MAX_STRUCTURED_SPEC_BYTES} bytes"
        if self.kind != "json_object" and not self.spec:
            return f"{self.field} is empty"
        if self.reasoning not in REASONING_PLACES:
            return f"{self.field}: the reasoning before it must be one of {', '.join(REASONING_PLACES)}"
        return self._alternative_problem()

    def _alternative_problem(self) -> str | None:
        other = self.alternative
        if other is None:
            return None
        if not isinstance(other, StructuredOutput) or other.alternative is not None or other.reasoning != "none":
            return f"{self.field}: its alternative must be a constraint without reasoning or an alternative of its own"
        return other.problem()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens.

    `temperature` is in [0, 100]; any value below `MIN_TEMPERATURE` (1e-5), 0 included, means greedy:
    the most likely token every time, with no random draw.
    """

    # None: the rest of the context (as vLLM does), as far as the KV pool holds it; never a lower cap.
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token; None = off
    # OpenAI's: (token id, bias in [-100, 100]) added to that token's logit before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's, in [-2, 2]: subtracted once from the logit of every token the output holds already
    # (presence), and once per occurrence (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and Hugging Face's, > 0: the logit of a token in the prompt or the output is divided by it
    # when positive and multiplied by it when negative; 1 = off.
    repetition_penalty: float = 1.0
    structured: StructuredOutput | None = None  # None: the output is unconstrained
    # Special tokens the output's text keeps (every other special token is left out of it, as by default):
    # the markers a tool-call format or reasoning is read by (`[TOOL_CALLS]`, `<|python_tag|>`).
    kept_special_tokens: frozenset[int] = frozenset()

    @property
    def penalized(self) -> bool:
        """Whether picks depend on the sample's own tokens: it then needs a slot of token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self, vocab_size: int) -> None:
        """Raises RequestRejected naming the first setting of the wrong type or out of range."""
        # Each check is a thunk so a type check guards the range check after it.
        checks = (
            (lambda: self.max_tokens is None or (is_integer(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens must be an integer >= 1"),
            (lambda: _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
             "temperature must be a number between 0 and 100"),
            (lambda: is_integer(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (lambda: _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be a number in (0, 1]"),
            (lambda: _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be a number in [0, 1]"),
            (lambda: is_integer(self.n) and 1 <= self.n <= MAX_SAMPLES, f"n must be an integer between 1 and {MAX_SAMPLES}"),
            (lambda: self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**63), "seed must be an integer in [0, 2^63)"),
            (lambda: isinstance(self.stop, (tuple, list)) and all(isinstance(s, str) for s in self.stop),
             "stop must be a list of strings"),
            (lambda: len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (lambda: all(0 < len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop), "stop strings must be 1-256 characters"),
            (lambda: isinstance(self.stop_token_ids, (tuple, list))
             and all(is_integer(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
             "stop_token_ids must be valid token ids"),
            # Never more alternatives than the model has tokens: the sampler's top-k would fail the whole batch.
            (lambda: self.logprobs is None
             or (is_integer(self.logprobs) and 0 <= self.logprobs <= min(MAX_LOGPROBS, vocab_size)),
             f"logprobs must be an integer between 0 and {min(MAX_LOGPROBS, vocab_size)}"),
            (lambda: _valid_logit_bias(self.logit_bias, vocab_size),
             f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} valid token ids to numbers between -100 and 100"),
            (lambda: _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be a number between -2 and 2"),
            (lambda: _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be a number between -2 and 2"),
            (lambda: _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
             "repetition_penalty must be a number in (0, 100]"),
            (lambda: self.structured is None or isinstance(self.structured, StructuredOutput),
             "structured must be a StructuredOutput"),
            (lambda: isinstance(self.kept_special_tokens, frozenset)
             and all(is_integer(t) and 0 <= t < vocab_size for t in self.kept_special_tokens),
             "kept_special_tokens must be valid token ids"),
        )
        for ok, message in checks:
            if not ok():
                raise RequestRejected("invalid_sampling", message)
        problem = None if self.structured is None else self.structured.problem()
        if problem is not None:
            raise RequestRejected("invalid_structured_output", problem)


def is_integer(value: object) -> bool:
    """A true `int`: not a bool (an int subclass), not a float or string that could pass for one."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid_logit_bias(bias: object, vocab_size: int) -> bool:
    if not isinstance(bias, (tuple, list)) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return False
    return all(
        isinstance(entry, (tuple, list)) and len(entry) == 2 and is_integer(entry[0]) and 0 <= entry[0] < vocab_size
        and _is_number(entry[1]) and -100.0 <= entry[1] <= 100.0
        for entry in bias
    )
