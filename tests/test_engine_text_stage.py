"""The text stage beside the engine core: the core's loop steps tokens only (`LLMEngine.step_tokens`),
text, stop strings and holdback are made by `OutputProcessor`, in-process (`LLMEngine.step`) or on the
core client's reader thread. Through the core's pipe the answers are exactly the in-process ones, a
stop string stops its sample in the core (its blocks freed and zeroed, its siblings going on), and the
tokens the core made after the stop never reach anyone."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import engine.detokenizer as detokenizer_module
from engine import EngineConfig, EngineError, LLMEngine, SamplingParams, StreamDelta
from engine.core_client import EngineCoreClient
from engine.output_processor import OutputProcessor
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from tests.engine_models import running_core, tiny_model_dir

CONFIG = EngineConfig(kv_cache_gib=0.05, device="cpu")
PROMPT = "tell me a story"
NEVER = "\u2603"  # the tiny model's vocabulary cannot write it


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCoreClient]:
    with running_core(tiny_model_dir(), CONFIG) as client:
        yield client


@pytest.fixture(scope="module")
def oracle() -> LLMEngine:
    return LLMEngine(tiny_model_dir(), CONFIG)


def free_run(oracle: LLMEngine, params: SamplingParams) -> RequestOutput:
    return oracle.generate([PROMPT], params)[0]


def spanning_stop(tokenizer: Tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string whose first two characters are the end of one token's text and whose
    last two begin a later token's, found first where it ends; and how many tokens complete it."""
    for k in range(2, len(token_ids) - 2):
        head = tokenizer.decode(token_ids[:k])
        at = len(head)
        stop = text[at - 2 : at + 2]
        if text.startswith(head) and len(stop) == 4 and "\ufffd" not in text[: at + 2] and text.find(stop) == at - 2:
            completing = next(j for j in range(k + 1, len(token_ids) + 1)
                              if stop in tokenizer.decode(token_ids[:j]))
            return stop, completing
    raise AssertionError("no output text has a usable stop string")


def per_sample(deltas: list[StreamDelta]) -> dict[int, list[tuple]]:
    samples: dict[int, list[tuple]] = {}
    for delta in deltas:
        samples.setdefault(delta.index, []).append(
            (delta.text, delta.token_ids, delta.finish_reason, tuple((p.token_id, p.logprob) for p in delta.logprobs)))
    return samples


def in_process_deltas(oracle: LLMEngine, params: SamplingParams) -> list[StreamDelta]:
    oracle.add_request(PROMPT, params)
    return list(oracle.stream())


def assert_same_answers(node: list[StreamDelta], local: list[StreamDelta]) -> None:
    """The same deltas per sample, one request-final delta (the last) with the same token count."""
    assert per_sample(node) == per_sample(local)
    for deltas in (node, local):
        assert [d.request_finished for d in deltas].count(True) == 1 and deltas[-1].request_finished
    assert node[-1].metrics.output_tokens == local[-1].metrics.output_tokens == sum(len(d.token_ids) for d in node)


# ----- through the core's pipe, exactly what LLMEngine gives -----------------------------------------


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.8, seed=3, logprobs=2)],
                         ids=["greedy", "sampled"])
def test_a_stop_string_spanning_tokens_ends_the_sample_as_in_process(core, oracle, settings) -> None:
    settings, free, stop, completing = stop_case(oracle, settings)
    stopping = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop, NEVER), **settings)

    local = in_process_deltas(oracle, stopping)
    node = list(core.submit(PROMPT, stopping).deltas())

    assert_same_answers(node, local)
    got = RequestOutput("r", [])
    for delta in node:
        got.add(delta)
    answer = got.outputs[0]
    assert answer.text == free.text[: free.text.find(stop)] and answer.finish_reason is FinishReason.STOP
    # The token that completed the stop string is kept; none after it, though the core may have made more.
    assert answer.token_ids == free.token_ids[:completing]
    assert len(answer.logprobs) == (completing if settings.get("logprobs") else 0)
    assert got.metrics.output_tokens == completing


def stop_case(oracle: LLMEngine, settings: dict) -> tuple[dict, CompletionOutput, str, int]:
    """The settings (a sampled one's seed the first from its own up that gives one), the free run's answer,
    a usable stop string in it, and the tokens that complete it."""
    seeds = [None] if "seed" not in settings else range(settings["seed"], settings["seed"] + 100)
    for seed in seeds:
        chosen = settings if seed is None else {**settings, "seed": seed}
        free = free_run(oracle, SamplingParams(max_tokens=24, ignore_eos=True, **chosen)).outputs[0]
        try:
            return (chosen, free, *spanning_stop(oracle.tokenizer, free.token_ids, free.text))
        except AssertionError:
            continue
    raise AssertionError("no seed draws an answer with a usable stop string")


def sibling_case(oracle: LLMEngine) -> tuple[dict, str, int]:
    """Settings of two sampled siblings, the first seed's from 7 up whose first sample's text has a usable
    stop string that its sibling's never meets (the premise); the string, and the tokens that complete it."""
    for seed in range(7, 107):
        settings = dict(max_tokens=20, temperature=0.8, seed=seed, n=2, ignore_eos=True)
        first, second = free_run(oracle, SamplingParams(**settings)).outputs
        try:
            stop, completing = spanning_stop(oracle.tokenizer, first.token_ids, first.text)
        except AssertionError:
            continue
        if stop not in second.text:
            return settings, stop, completing
    raise AssertionError("no seed draws a sample with a usable stop string that its sibling never meets")


def test_of_two_samples_one_stops_by_string_and_its_sibling_runs_to_its_length(core, oracle) -> None:
    settings, stop, completing = sibling_case(oracle)
    stopping = SamplingParams(stop=(stop,), **settings)

    local = in_process_deltas(oracle, stopping)
    node = list(core.submit(PROMPT, stopping).deltas())

    assert_same_answers(node, local)
    ends = {d.index: d.finish_reason for d in node if d.finish_reason}
    assert ends == {0: FinishReason.STOP, 1: FinishReason.LENGTH}
    assert node[-1].metrics.output_tokens == completing + 20


def test_a_held_back_stop_string_prefix_that_is_not_one_is_released(core, oracle) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = free_run(oracle, params).outputs[0]
    prefix, _ = spanning_stop(oracle.tokenizer, free.token_ids, free.text)
    teasing = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(prefix + NEVER,))

    local = in_process_deltas(oracle, teasing)
    node = list(core.submit(PROMPT, teasing).deltas())

    assert_same_answers(node, local)
    assert "".join(d.text for d in node) == free.text and node[-1].finish_reason is FinishReason.LENGTH
    # The premise: where a token's text ended in the stop string's first two characters, they were held.
    streamed, tokens, held = "", [], False
    for delta in node:
        streamed, tokens = streamed + delta.text, tokens + list(delta.token_ids)
        held = held or oracle.tokenizer.decode(tokens) == streamed + prefix[:2]
    assert held


# ----- the core stops the sample ----------------------------------------------------------------


def test_the_core_stops_a_sample_its_client_found_a_stop_string_in_and_zeroes_its_blocks(core, oracle) -> None:
    long = dict(max_tokens=1000, temperature=0.0, ignore_eos=True)
    free = free_run(oracle, SamplingParams(**dict(long, max_tokens=24))).outputs[0]
    stop, completing = spanning_stop(oracle.tokenizer, free.token_ids, free.text)
    seen = []  # what the core sent, as the client's text stage read it
    text = core._text
    process = text.process
    text.process = lambda outputs: (seen.extend(outputs), process(outputs))[1]
    try:
        core.take_zeroing()  # a fresh tally
        deltas = list(core.submit(PROMPT, SamplingParams(stop=(stop,), **long)).deltas())
    finally:
        del text.process
    assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].metrics.output_tokens == completing
    # The core ended it at its client's word (no stop token, EOS ignored: STOP can come from nothing else),
    # long before its length; the tokens it made meanwhile were dropped.
    ends = [output for output in seen if output[4] is not None]
    assert [(end[4], end[5] is not None) for end in ends] == [(FinishReason.STOP, True)]
    assert completing <= sum(len(output[2]) for output in seen) < 1000
    report = core.take_zeroing()
    assert report.requests_ended == 1 and report.blocks >= 1 and report.residue == 0
    assert core.residue_check() == [] and len(text) == 0  # nothing of it left on either side


def test_finish_sample_frees_and_zeroes_one_sample_and_its_sibling_goes_on(oracle) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    expected = free_run(oracle, params).outputs[1].token_ids
    llm = LLMEngine(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu", detokenize=False))
    request_id = llm.add_request(PROMPT, params)
    outputs = [llm.step_tokens() for _ in range(4)]  # the prefill and three decode steps: both samples hold blocks
    used = llm.block_manager.num_blocks - llm.block_manager.num_free_blocks
    llm.finish_sample(request_id, 0)
    assert llm.block_manager.num_blocks - llm.block_manager.num_free_blocks < used  # its own block went back
    assert llm.residue_check() == []  # and was zeroed before finish_sample returned
    llm.finish_sample(request_id, 0)  # ended already: nothing happens
    while llm.has_unfinished():
        outputs.append(llm.step_tokens())
    flat = [output for step in outputs for output in step]
    ends = [(o[1], o[4], o[5] is not None) for o in flat if o[4] is not None]
    assert ends == [(0, FinishReason.STOP, False), (1, FinishReason.LENGTH, True)]
    assert [t for o in flat if o[1] == 1 for t in o[2]] == expected
    assert flat[-1][5].output_tokens == 4 + 12
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks and llm.residue_check() == []


def test_an_aborted_or_refused_requests_text_is_forgotten_at_once(core) -> None:
    handle = core.submit(PROMPT, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True, stop=("zz",)))
    next(handle.deltas())
    assert len(core._text) == 1
    handle.close()
    assert len(core._text) == 0
    refused = core.submit([10**9], SamplingParams(max_tokens=4))  # no such token: the core refuses it
    with pytest.raises(EngineError):
        list(refused.deltas())
    assert len(core._text) == 0
    # Nothing is made per sample before the core has accepted the request's `n` (here it refuses it).
    absurd = core.submit(PROMPT, SamplingParams(max_tokens=4, n=10**9))
    assert all(not request.samples for request in list(core._text._requests.values()))  # or refused already
    with pytest.raises(EngineError):
        list(absurd.deltas())
    assert len(core._text) == 0


# ----- the token step makes no text ---------------------------------------------------------------


def test_the_token_step_never_decodes(monkeypatch, oracle) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=9, n=2, logprobs=1, ignore_eos=True, stop=("e", "a"))
    expected = [o.token_ids for o in free_run(oracle, SamplingParams(
        max_tokens=10, temperature=0.8, seed=9, n=2, logprobs=1, ignore_eos=True)).outputs]
    llm = LLMEngine(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu", detokenize=False))

    def refuse(*arguments, **keywords):
        raise AssertionError("the token step decoded")

    for name in ("decode", "decoder", "token_texts"):
        monkeypatch.setattr(Tokenizer, name, refuse)
    monkeypatch.setattr(detokenizer_module, "step_batch", refuse)
    monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "step", refuse)
    llm.add_request(PROMPT, params)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    while llm.has_unfinished():
        for _, index, new, logprobs, _, _ in llm.step_tokens():
            tokens[index] += new
            assert len(logprobs) == len(new)
    assert [tokens[0], tokens[1]] == expected  # stop strings are the text stage's: the core runs to length
    assert llm.output is None
    with pytest.raises(EngineError, match="steps tokens only"):
        llm.step()


# ----- the text stage alone -----------------------------------------------------------------------


def metrics(output_tokens: int) -> RequestMetrics:
    return RequestMetrics(prompt_tokens=3, output_tokens=output_tokens, arrival_time=1.0, first_token_time=2.0,
                          finish_time=3.0)


def test_tokens_the_core_made_after_a_stop_string_are_dropped_and_the_last_delta_waits_for_the_core(oracle) -> None:
    tokenizer = oracle.tokenizer
    ids = tokenizer.encode("hello world again and again", add_special_tokens=False)
    stop = tokenizer.decode(ids[:3])[-3:]
    text = OutputProcessor(tokenizer)
    text.add("r", SamplingParams(max_tokens=50, stop=(stop,)))

    first, asked = text.process([("r", 0, ids[:3], [], None, None)])
    assert asked == [("r", 0)] and stop not in "".join(d.text for d in first)
    assert all(d.finish_reason is None for d in first)  # held: the core has not ended it yet
    # The core, not yet told, made two more tokens; then it ends the sample at the client's word.
    later, asked_again = text.process([("r", 0, ids[3:4], [], None, None)])
    assert later == [] and asked_again == []  # dropped, and asked once only
    last, _ = text.process([("r", 0, ids[4:5], [], FinishReason.STOP, metrics(5))])
    assert [d.finish_reason for d in last] == [FinishReason.STOP]
    whole = first + last
    assert sum(len(d.token_ids) for d in whole) == 3 and whole[-1].metrics.output_tokens == 3
    assert "".join(d.text for d in whole) == tokenizer.decode(ids[:3])[:-3]
    assert len(text) == 0  # forgotten with its last delta


def test_a_stop_string_wins_over_the_cores_own_end_in_the_same_tokens(oracle) -> None:
    tokenizer = oracle.tokenizer
    ids = tokenizer.encode("hello world again", add_special_tokens=False)
    stop = tokenizer.decode(ids)[-2:]
    text = OutputProcessor(tokenizer)
    text.add("r", SamplingParams(max_tokens=len(ids), stop=(stop,)))
    deltas, asked = text.process([("r", 0, ids, [], FinishReason.LENGTH, metrics(len(ids)))])
    assert asked == []  # the core has ended it already
    assert [(d.text, d.finish_reason) for d in deltas] == [(tokenizer.decode(ids)[:-2], FinishReason.STOP)]


def test_several_tokens_at_once_are_cut_after_the_one_that_completes_a_stop_string(oracle) -> None:
    tokenizer = oracle.tokenizer
    ids = tokenizer.encode("hello world again and again", add_special_tokens=False)
    stop = tokenizer.decode(ids[:2])[-2:]
    assert stop not in tokenizer.decode(ids[:1])  # the premise: the second token completes it
    text = OutputProcessor(tokenizer)
    text.add("r", SamplingParams(max_tokens=50, stop=(stop,)))
    logprobs = [object() for _ in ids[:4]]  # kept by position only
    held, asked = text.process([("r", 0, ids[:4], logprobs, None, None)])  # a speculative step's accepted tokens
    assert held == [] and asked == [("r", 0)]
    deltas, _ = text.process([("r", 0, [], [], FinishReason.STOP, metrics(4))])
    assert deltas[0].token_ids == tuple(ids[:2]) and deltas[0].logprobs == tuple(logprobs[:2])
    assert deltas[0].metrics.output_tokens == 2


# ----- privacy ------------------------------------------------------------------------------------


def test_nothing_of_the_text_reaches_a_log_or_stderr(core, oracle, capfd, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = free_run(oracle, params).outputs[0]
    stop, _ = spanning_stop(oracle.tokenizer, free.token_ids, free.text)
    capfd.readouterr()
    deltas = list(core.submit(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))).deltas())
    answer = "".join(d.text for d in deltas)
    assert len(answer) > 2 and deltas[-1].finish_reason is FinishReason.STOP  # the premise: there is text to leak
    captured = capfd.readouterr()
    for secret in (stop, answer, PROMPT):
        assert secret not in captured.out + captured.err and secret not in caplog.text
    assert all(stop not in repr(d) and answer not in repr(d) for d in deltas)
