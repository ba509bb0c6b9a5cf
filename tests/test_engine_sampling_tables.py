"""Per-sample sampling settings on the device: written once, advanced by the picks, zeroed when the sample ends."""

from __future__ import annotations

import pytest
import torch

from engine.bridge import Bridge
from engine.sampler import SampleRequest, Sampler
from engine.sampling_params import SamplingParams
from engine.sampling_tables import SamplingTables
from tests.engine_models import random_prompts, tiny_engine

CPU = torch.device("cpu")
PARAMS = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5, seed=3,
                        logit_bias=((4, 2.5), (9, -1.0)))


def step(bridge: Bridge, tables: SamplingTables, keys, params, seeds, positions, vocab_size=100):
    """One step's pack, gather and advance, as a sampler runs them; returns (plan, gathered values)."""
    upload = bridge.upload()
    rows = [SampleRequest(0, p, seed, position, sample=key)
            for key, p, seed, position in zip(keys, params, seeds, positions)]
    slots, plan = tables.pack(upload, rows, vocab_size)
    views = bridge.send(upload)
    slots = torch.tensor(slots, dtype=torch.int64)
    values = tables.gather(plan, views, slots)
    tables.advance(plan, slots, torch.tensor(plan.transient, dtype=torch.int64))
    return plan, values


def test_a_sample_is_written_at_its_first_pick_and_its_position_advances_on_the_device():
    bridge, tables = Bridge(CPU), SamplingTables(CPU)
    for position in range(4):
        plan, values = step(bridge, tables, [7], [PARAMS], [123], [position])
        assert plan.written == (position == 0)
        assert values.ints.tolist() == [[5, 123, position]]
        assert values.floats[0].tolist() == pytest.approx([0.7, 0.9, 0.1, 1.0, 0.0, 0.5])
        assert values.bias_tokens.tolist() == [[4, 9]] and values.bias_values.tolist() == [[2.5, -1.0]]


def test_a_position_moved_otherwise_than_by_one_pick_is_written_again():
    bridge, tables = Bridge(CPU), SamplingTables(CPU)
    step(bridge, tables, [7], [PARAMS], [123], [0])
    plan, values = step(bridge, tables, [7], [PARAMS], [123], [4])  # a speculative step emitted four
    assert plan.written == 1 and values.ints[0, 2] == 4


def test_an_ended_samples_slot_is_zeroed_and_the_next_sample_reads_only_its_own_settings():
    bridge, tables = Bridge(CPU), SamplingTables(CPU)
    step(bridge, tables, [7, 8], [PARAMS, PARAMS], [123, 456], [0, 0])
    slot = tables.slot_of[7]
    tables.release(7)
    assert tables.held == 1
    assert not tables.ints[slot].any() and not tables.floats[slot].any()
    assert not tables.bias_tokens[slot].any() and not tables.bias_values[slot].any()
    other = SamplingParams(temperature=1.3)
    _, values = step(bridge, tables, [9], [other], [77], [0])  # top-k off: the whole vocabulary
    assert tables.slot_of[9] == slot  # the freed slot serves the next sample
    assert values.ints.tolist() == [[100, 77, 0]]
    assert values.floats[0].tolist() == pytest.approx([1.3, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert not values.bias_tokens.any() and not values.bias_values.any()  # none of the ended sample's bias
    tables.release(8)
    tables.release(9)
    assert tables.held == 0 and not tables.ints.any() and not tables.floats.any()
    assert not tables.bias_tokens.any() and not tables.bias_values.any()


def test_picks_that_name_no_sample_hold_their_slots_for_their_step_alone():
    sampler = Sampler()
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    sampler(logits, [SampleRequest(row, PARAMS, seed=11 + row, position=row) for row in range(3)])
    tables = sampler.tables
    assert tables.held == 0 and not tables.ints.any() and not tables.floats.any()


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_an_engines_sampling_state_is_zeroed_as_each_sample_ends_aborted_or_finished(overlapped):
    llm = tiny_engine(num_blocks=64, block_size=4, async_scheduling=overlapped)
    params = SamplingParams(max_tokens=12, temperature=0.8, n=2, seed=5, ignore_eos=True, frequency_penalty=0.4,
                            logit_bias=((7, 1.5),))
    first, second = (llm.add_request(prompt, params) for prompt in random_prompts(2, 4, 8, seed=9))
    for _ in range(4):
        llm.step()
    tables = llm.sampler.tables
    assert tables.held == 4 and tables.ints.any()  # both requests' two samples hold settings now
    slots = [tables.slot_of[seq.seq_id] for seq in llm._requests[first].sequences]
    llm.abort(first)
    assert tables.held == 2
    assert not tables.ints[slots].any() and not tables.floats[slots].any() and not tables.bias_tokens[slots].any()
    while llm.has_unfinished():
        llm.step()
    assert second not in llm._requests
    assert tables.held == 0 and not tables.ints.any() and not tables.floats.any()
    assert not tables.bias_tokens.any() and not tables.bias_values.any()


def test_the_races_noise_block_is_reused_from_step_to_step_and_grows_only_for_more_rows():
    sampler = Sampler(draw_kind="race")
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    sampler(logits, [SampleRequest(row, PARAMS, seed=row, position=0) for row in range(6)])
    buffers = sampler._noise
    first = (buffers.bits.data_ptr(), buffers.noise.data_ptr())
    for position in range(1, 4):
        sampler(logits, [SampleRequest(row, PARAMS, seed=row, position=position) for row in range(6)])
        assert (buffers.bits.data_ptr(), buffers.noise.data_ptr()) == first
    sampler(logits, [SampleRequest(row % 6, PARAMS, seed=row, position=0) for row in range(20)])
    assert buffers.bits.shape[0] >= 20


def test_a_step_whose_picks_never_ran_leaves_no_slot_believed_written():
    bridge, tables = Bridge(CPU), SamplingTables(CPU)
    upload = bridge.upload()  # packed and sent, never picked: the step failed before its picks
    tables.pack(upload, [SampleRequest(0, PARAMS, 123, 0, sample=7), SampleRequest(0, PARAMS, 5, 0)], 100)
    bridge.send(upload)
    plan, values = step(bridge, tables, [7], [PARAMS], [123], [1])  # the sample's next pick
    assert plan.written == 1 and values.ints.tolist() == [[5, 123, 1]]
    assert tables.held == 1  # the failed step's one-step slot is free again
    tables.release(7)
    assert tables.held == 0 and not tables.ints.any()
