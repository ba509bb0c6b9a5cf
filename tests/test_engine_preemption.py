"""Preemption under a full KV pool does not thrash: the youngest request is the victim, and a waiting one is
admitted only when its whole prefill fits. Counts, not times: the same on any machine.

Each preemption throws away the tokens its victim had computed, which are computed again once it is
readmitted; the minimum prefill work is the prompts' tokens. `benchmarks/engine_preemption.py` prints the
same counts for a larger workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sequence import Sequence
from tests.engine_models import tiny_model_dir

BLOCK_SIZE = 4


@dataclass
class Preemptions:
    """What each preemption threw away, and whom it chose among whom."""

    recomputed_tokens: int = 0
    victims_not_youngest: list[int] = field(default_factory=list)
    running_out_of_order: int = 0


def watch(engine: LLMEngine) -> Preemptions:
    """Wraps the real scheduler's `preempt` and `schedule` to record (the scheduler runs unchanged)."""
    scheduler, seen = engine.scheduler, Preemptions()
    preempt, schedule = scheduler.preempt, scheduler.schedule

    def order(seq: Sequence) -> int:
        return int(seq.request_id.removeprefix("r"))

    def recording_preempt(seq: Sequence) -> None:
        if order(seq) != max(order(other) for other in scheduler.running):
            seen.victims_not_youngest.append(order(seq))
        seen.recomputed_tokens += seq.num_computed_tokens
        preempt(seq)

    def recording_schedule():
        chunks = schedule()
        orders = [order(seq) for seq in scheduler.running]
        seen.running_out_of_order += orders != sorted(orders)
        return chunks

    scheduler.preempt, scheduler.schedule = recording_preempt, recording_schedule
    return seen


def crowded_run(num_blocks: int, requests: int = 32, seed: int = 7) -> tuple[LLMEngine, Preemptions, int]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 250) for _ in range(rng.randint(8, 60))] for _ in range(requests)]
    # Every third request has two samples: the second is forked once the prompt is computed, and runs in its
    # request's place, not as the youngest.
    params = [SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True, temperature=0.0 if index % 3 else 0.7,
                             n=1 if index % 3 else 2, seed=index) for index in range(requests)]
    engine = LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                                      max_num_batched_tokens=64, async_scheduling=False))
    seen = watch(engine)
    for index, (prompt, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, sampling, request_id=f"r{index:03d}")  # ids in arrival order
    while engine.has_unfinished():
        engine.step()
    return engine, seen, sum(len(p) for p in prompts)


@pytest.mark.parametrize("num_blocks", [64])
def test_the_victim_is_always_the_youngest_request_and_the_running_stay_in_arrival_order(num_blocks) -> None:
    engine, seen, _ = crowded_run(num_blocks)
    assert engine.scheduler.num_preemptions > 0  # the pool is full: it must preempt
    assert seen.victims_not_youngest == []
    assert seen.running_out_of_order == 0


@pytest.mark.parametrize("num_blocks", [64])
def test_a_full_pool_redoes_little_prefill_work(num_blocks) -> None:
    """Before: the request readmitted last was the next victim (often the oldest, preempted again and again)
    and a prompt was admitted on its first chunk's room; about half the prompts' tokens were computed again."""
    engine, seen, prompt_tokens = crowded_run(num_blocks)
    assert seen.recomputed_tokens <= prompt_tokens * 0.45, (seen.recomputed_tokens, prompt_tokens)  # before: 0.60
    assert engine.scheduler.num_recomputed_tokens == seen.recomputed_tokens  # the scheduler counts them too
