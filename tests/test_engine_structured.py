"""Structured outputs in the engine: every constrained answer is in its language, and grammar state
lives and dies with its request.

The models are the random-weight tiny ones, so nothing but the mask makes an answer parse: JSON
schemas are generated (hypothesis) with finite languages, so every answer ends before max_tokens, and
each must parse and validate (`jsonschema`). n > 1, streaming, logprobs, stop strings, async
scheduling and preemption by recompute each keep that; the grammar's matchers are unreachable once
their request ends, and two requests with the same schema never share one.
"""

from __future__ import annotations

import gc
import json
import re
import weakref

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, RequestRejected, SamplingParams
from engine.sampling_params import MAX_STRUCTURED_SPEC_BYTES, StructuredOutput
from engine.structured import Guide
from tests.engine_models import one_torch_thread, tiny_model_dir  # noqa: F401

# 40 blocks of 4 tokens and 32 tokens a step: eight samples of up to ~90 tokens cannot all stay resident.
TIGHT = {"num_blocks": 40, "block_size": 4, "max_num_batched_tokens": 32}
SMALL_POOL = {"kv_cache_gib": 0.01}
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict]:
    bounded_int = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    string = st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.one_of(st.text(max_size=4), st.integers(-9, 9), st.booleans()), min_size=1, max_size=4,
                    unique=True).map(lambda values: {"enum": values})
    return st.one_of(bounded_int, string, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """OpenAI's strict form: every property required, no others allowed."""
    return st.dictionaries(_NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


def _array(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})


SCHEMAS = st.recursive(_leaf(), lambda children: st.one_of(_object(children), _array(children)), max_leaves=6)


def structured(kind: str, spec: str = "", field: str = "response_format") -> StructuredOutput:
    return StructuredOutput(kind, spec, field)


def json_schema(schema: dict) -> StructuredOutput:
    return structured("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def constrained(constraint: StructuredOutput, max_tokens: int = 400, **extra) -> SamplingParams:
    extra.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=max_tokens, structured=constraint, **extra)


def texts(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list[list[tuple[str, str]]]:
    """Per request, per sample: (text, finish reason)."""
    return [[(c.text, c.finish_reason.value) for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_model_dir(), EngineConfig(**SMALL_POOL))


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLMEngine]:
    """A synchronous and an overlapped engine, shared by the property's examples."""
    return {overlapped: LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=overlapped, **SMALL_POOL))
            for overlapped in (False, True)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31), overlapped=st.booleans())
def test_every_json_schema_answer_parses_and_validates(engines, schema, seed, overlapped):
    engine = engines[overlapped]
    wrapped = {"type": "object", "properties": {"answer": schema}, "required": ["answer"], "additionalProperties": False}
    params = [constrained(json_schema(wrapped), seed=seed, n=2), constrained(json_schema(schema), temperature=0.0)]
    for samples in texts(engine, ["Answer in JSON:", "Veil"], params):
        for text, reason in samples:
            assert reason == "stop"
            answer = json.loads(text)
            jsonschema.validate(answer, wrapped if isinstance(answer, dict) and "answer" in answer else schema)


def test_json_object_answers_parse_as_objects(engine):
    params = [constrained(structured("json_object"), max_tokens=300, seed=s, n=2) for s in range(4)]
    # An object with any keys and values is an unbounded language: an answer ends when the model closes
    # it, or at max_tokens; every one that ends on its own parses.
    finished = [t for samples in texts(engine, ["{"] * 4, params) for t, reason in samples if reason == "stop"]
    assert finished
    assert all(isinstance(json.loads(text), dict) for text in finished)


@pytest.mark.parametrize(("constraint", "check"), [
    (structured("regex", r"[0-9]{3}-[a-z]{2,4}", "guided_regex"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    # Nested quantifiers: a backtracking engine takes exponential time on such a pattern; llguidance's
    # derivative-based lexer does not backtrack.
    (structured("regex", r"(a+)+b", "guided_regex"), lambda t: re.fullmatch(r"(a+)+b", t)),
    (structured("choice", json.dumps(["yes", "no", "maybe later"]), "guided_choice"),
     lambda t: t in ("yes", "no", "maybe later")),
    (structured("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/', "guided_grammar"),
     lambda t: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", t)),
])
def test_regex_choice_and_grammar_answers_are_in_their_language(engine, constraint, check):
    params = [constrained(constraint, max_tokens=60, seed=s, n=2) for s in range(3)]
    for samples in texts(engine, ["x", "Hello", "The quick"], params):
        for text, reason in samples:
            if reason == "stop":
                assert check(text)
            else:  # an unbounded language may run to max_tokens: its text is still a prefix of an answer
                assert reason == "length" and constraint.kind in ("regex", "grammar")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_async_scheduling_and_preemption_give_what_the_plain_engine_gives(overlapped):
    plain = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=False, **SMALL_POOL))
    tight = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=overlapped, **TIGHT))
    prompts = ["Hello there, how are you", "Once upon a time", "The quick brown fox", "Veil answers"]
    params = [constrained(json_schema(SCHEMA), max_tokens=80, seed=7 + i, n=2, presence_penalty=0.5)
              for i in range(4)]
    expected = texts(plain, prompts, params)
    assert texts(tight, prompts, params) == expected
    assert tight.scheduler.num_preemptions > 0
    for samples in expected:
        for text, _ in samples:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_deltas_and_logprobs_follow_the_constrained_tokens(engine):
    params = constrained(json_schema(SCHEMA), seed=3, logprobs=2)
    request_id = engine.add_request("Stream me", params)
    streamed, tokens, logprobs = "", [], []
    for delta in engine.stream():
        if delta.request_id == request_id:
            streamed += delta.text
            tokens += delta.token_ids
            logprobs += delta.logprobs
    jsonschema.validate(json.loads(streamed), SCHEMA)
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 2 for lp in logprobs)


def test_a_stop_string_ends_a_constrained_answer_where_it_appears(engine):
    params = constrained(json_schema(SCHEMA), temperature=0.0, stop=['"age"'])
    (text, reason), = texts(engine, ["Hi"], [params])[0]
    assert reason == "stop" and text.startswith('{"name":') and '"age"' not in text


def test_the_end_token_and_stop_tokens_wait_for_the_grammar(engine):
    """A bias of +100 on EOS and on a stop token cannot end the answer before the grammar accepts it."""
    eos = sorted(engine.eos_token_ids)[0]
    stop_token = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    params = constrained(json_schema(SCHEMA), seed=1, n=2, logit_bias=((eos, 100.0), (stop_token, 100.0)),
                         stop_token_ids=(stop_token,))
    for text, reason in texts(engine, ["Hi"], [params])[0]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


# ----- grammar state is request-scoped ---------------------------------------------------------


def _guides(engine: LLMEngine, request_id: str) -> list[weakref.ref]:
    return [weakref.ref(seq.guide) for seq in engine._requests[request_id].sequences if seq.guide is not None]


def test_nothing_of_a_grammar_is_reachable_after_its_request_ends():
    engine = LLMEngine(tiny_model_dir(), EngineConfig(**SMALL_POOL))
    request_id = engine.add_request("Hello", constrained(json_schema(SCHEMA), seed=2, n=3))
    engine.step()  # the prompt: the request's three samples fork, each with its own matcher
    guides = _guides(engine, request_id)
    assert len(guides) == 3 and len({id(g()) for g in guides}) == 3
    for _ in engine.stream():
        pass
    gc.collect()
    assert all(g() is None for g in guides)
    assert not [o for o in gc.get_objects() if type(o) is Guide]


def test_an_aborted_request_drops_its_matchers():
    engine = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=True, **SMALL_POOL))
    request_id = engine.add_request("Hello", constrained(json_schema(SCHEMA), seed=2, n=2))
    engine.step()
    engine.step()
    guides = _guides(engine, request_id)
    assert len(guides) == 2
    engine.abort(request_id)
    for _ in engine.stream():
        pass
    gc.collect()
    assert all(g() is None for g in guides)


def test_two_requests_with_one_schema_share_no_matcher():
    """Each request compiles its own: advancing one leaves the other where it was."""
    engine = LLMEngine(tiny_model_dir(), EngineConfig(**SMALL_POOL))
    params = constrained(json_schema(SCHEMA), temperature=0.0)
    first, second = engine.add_request("Hello", params), engine.add_request("Hello", params)
    (a,), (b,) = _guides(engine, first), _guides(engine, second)
    assert a() is not b() and a().matcher is not b().matcher
    token = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    assert a().advance(token)
    assert b().matcher.validate_tokens([token]) == 1 and a().matcher.validate_tokens([token]) == 0


# ----- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(("constraint", "category"), [
    (json_schema({"type": "string", "format": "secret-format-name"}), "does not implement"),
    (json_schema({"type": "object", "dependentSchemas": {"secretkey": {}}}), "does not implement"),
    (structured("json_schema", '{"type": "secret', "response_format.json_schema.schema"), "not valid JSON"),
    (structured("json_schema", '{"type": "array", "items": ' * 300 + "{}" + "}" * 300,
                "response_format.json_schema.schema"), "limits"),
    (structured("regex", "(secret", "guided_regex"), "not a valid regex"),
    (structured("choice", json.dumps(["secret", 3]), "guided_choice"), "list of non-empty strings"),
    (structured("grammar", "start: SECRETRULE", "guided_grammar"), "not a valid grammar"),
    (structured("regex", "a" * (MAX_STRUCTURED_SPEC_BYTES + 1), "guided_regex"), "bytes"),
    (structured("regex", "", "guided_regex"), "empty"),
    (structured("regex", "secret\ud800", "guided_regex"), "valid Unicode"),
    (structured("grammar", 'start: "secret\ud800"', "guided_grammar"), "valid Unicode"),
])
def test_a_constraint_that_cannot_be_served_is_refused_naming_its_field_and_not_its_content(engine, constraint,
                                                                                          category):
    with pytest.raises(RequestRejected) as refused:
        engine.add_request("Hello", constrained(constraint))
    message = str(refused.value)
    assert refused.value.reason == "invalid_structured_output"
    assert message.startswith(constraint.field) and category in message
    assert "secret" not in message.lower() and "SECRET" not in message
    assert not engine.has_unfinished()


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_what_a_constrained_step_crosses(overlapped):
    """Synchronous: the masks ride in the step's one upload. Async: a step that waits for a constrained
    sample's token sends its picks' settings and masks in one more upload, and still downloads once."""
    engine = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=overlapped, **SMALL_POOL))
    for seed in range(3):
        engine.add_request(f"Hello {seed}", constrained(json_schema(SCHEMA), max_tokens=60, seed=seed,
                                                        presence_penalty=0.5))
    running = []
    while engine.has_unfinished():
        engine.step()
        if engine.scheduler.has_work():  # the step after which nothing runs zeroes in a crossing of its own
            running.append((engine.runner.bridge.step.h2d, engine.runner.bridge.step.d2h))
    assert len(running) > 10 and set(running[1:]) == ({(2, 1)} if overlapped else {(1, 1)})  # past the prefill
