"""Streaming: per-request deltas add up to the offline result; the last one carries the request's metrics."""

from __future__ import annotations

from collections import defaultdict

from engine import FinishReason, LLMEngine, SamplingParams, StreamDelta
from engine.outputs import CompletionOutput
from tests.engine_models import greedy, one_torch_thread, random_prompts, tiny_engine  # noqa: F401 (fixtures)

PROMPTS = random_prompts(4, 3, 20, seed=41)
PARAMS = [
    greedy(9),
    SamplingParams(max_tokens=14, temperature=0.9, seed=8, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=6, temperature=1.2, top_k=50, seed=9, ignore_eos=True),
    greedy(1),
]


def stream_all(engine: LLMEngine, prompts, params) -> tuple[list[str], list[StreamDelta]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    return ids, list(engine.stream())


def joined(deltas: list[StreamDelta], request_id: str, index: int = 0) -> tuple[str, list[int], list]:
    mine = [d for d in deltas if d.request_id == request_id and d.index == index]
    return "".join(d.text for d in mine), [t for d in mine for t in d.token_ids], [lp for d in mine for lp in d.logprobs]


def test_stream_deltas_add_up_to_generate():
    expected = tiny_engine(num_blocks=64, block_size=4).generate(PROMPTS, PARAMS)
    ids, deltas = stream_all(tiny_engine(num_blocks=64, block_size=4), PROMPTS, PARAMS)
    for request_id, output in zip(ids, expected):
        text, tokens, logprobs = joined(deltas, request_id)
        assert tokens == output.outputs[0].token_ids
        assert text == output.outputs[0].text
        assert logprobs == output.outputs[0].logprobs
    assert len(deltas) > len(PROMPTS), "the stream came in one piece, not token by token"


def test_final_delta_of_each_request_carries_its_metrics():
    engine = tiny_engine(num_blocks=64, block_size=4)
    ids, deltas = stream_all(engine, PROMPTS, PARAMS)
    for request_id, prompt, params in zip(ids, PROMPTS, PARAMS):
        mine = [d for d in deltas if d.request_id == request_id]
        with_metrics = [d for d in mine if d.metrics is not None]
        assert with_metrics == [mine[-1]], "metrics must come once, on the request's last delta"
        metrics = mine[-1].metrics
        assert metrics.prompt_tokens == len(prompt)
        assert metrics.output_tokens == params.max_tokens == sum(len(d.token_ids) for d in mine)
        assert metrics.arrival_time <= metrics.first_token_time <= metrics.finish_time
        assert mine[-1].finish_reason is FinishReason.LENGTH
        assert all(d.finish_reason is None for d in mine[:-1])
        assert mine[-1].request_finished and not any(d.request_finished for d in mine[:-1])
    assert not engine.has_unfinished()


def test_metrics_count_the_prompt_as_the_tokenizer_encoded_it():
    engine = tiny_engine(num_blocks=64, block_size=4)
    engine.add_request("Once upon a time", greedy(3))
    final = list(engine.stream())[-1]
    assert final.metrics.prompt_tokens == len(engine.tokenizer.encode("Once upon a time"))


def test_requests_added_while_streaming_join_the_running_batch():
    engine = tiny_engine(num_blocks=64, block_size=4)
    first = engine.add_request(PROMPTS[0], greedy(12))
    late = None
    tokens: dict[str, list[int]] = defaultdict(list)
    late_tokens_when_first_finished = 0
    for delta in engine.stream():
        tokens[delta.request_id] += delta.token_ids
        if late is None and len(tokens[first]) == 3:
            late = engine.add_request(PROMPTS[1], greedy(4))
        if delta.request_id == first and delta.request_finished and late is not None:
            late_tokens_when_first_finished = len(tokens[late])
    assert late is not None and len(tokens[late]) == 4
    assert late_tokens_when_first_finished == 4, "the late request waited for the first to end"
    expected = tiny_engine(num_blocks=64, block_size=4).generate(PROMPTS[:2], [greedy(12), greedy(4)])
    assert [tokens[first], tokens[late]] == [o.outputs[0].token_ids for o in expected]


def test_n_samples_stream_as_indexed_deltas_matching_generate():
    params = SamplingParams(max_tokens=7, temperature=1.0, n=3, seed=12, ignore_eos=True)
    expected = tiny_engine(num_blocks=64, block_size=4).generate([PROMPTS[2]], params)[0]
    ids, deltas = stream_all(tiny_engine(num_blocks=64, block_size=4), [PROMPTS[2]], [params])
    for index in range(3):
        assert joined(deltas, ids[0], index)[1] == expected.outputs[index].token_ids
    assert [d.index for d in deltas if d.finish_reason is not None].count(2) == 1
    final = [d for d in deltas if d.metrics is not None]
    assert len(final) == 1 and final[0] is deltas[-1]
    assert final[0].metrics.output_tokens == 21


def test_reprs_show_no_text_or_token_ids():
    """Reprs end up in tracebacks and logs: they name sizes only."""
    delta = StreamDelta("req", 0, "CANARY secret text", (6131, 6132))
    output = CompletionOutput(index=0, text="CANARY secret text", token_ids=[6131, 6132])
    for shown in (repr(delta), repr(output)):
        assert "CANARY" not in shown and "6131" not in shown
    engine = tiny_engine(num_blocks=64, block_size=4)
    engine.add_request([413, 414, 415], greedy(2))
    engine.step()
    assert all("413" not in repr(seq) for seq in engine.scheduler.running)
