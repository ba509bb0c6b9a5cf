"""Block tables kept on the device: each step uploads only the entries that changed, and the device rows
always gather to exactly the step's tables, whatever the order of growth, copy on write and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bridge import Bridge
from engine.device_tables import DeviceBlockTables
from tests.engine_models import greedy, random_lengths, random_prompts, tiny_model_dir

CPU = torch.device("cpu")


def step(bridge: Bridge, tables: DeviceBlockTables, seqs: dict[int, list[int]]) -> tuple[list[list[int]], int]:
    upload = bridge.upload()
    plan = tables.pack(upload, list(seqs), list(seqs.values()))
    gathered = tables.step_tables(plan, bridge.send(upload))
    return gathered.tolist(), plan.diffs


def padded(seqs: dict[int, list[int]]) -> list[list[int]]:
    width = max(map(len, seqs.values()))
    return [table + [-1] * (width - len(table)) for table in seqs.values()]


def test_a_growing_table_sends_only_its_new_block():
    bridge, tables = Bridge(CPU), DeviceBlockTables(CPU, 8)
    seqs = {1: [4, 5], 2: [7]}
    assert step(bridge, tables, seqs) == (padded(seqs), 3)
    assert step(bridge, tables, seqs)[1] == 0  # nothing changed: nothing sent
    seqs[2].append(9)
    assert step(bridge, tables, seqs) == (padded(seqs), 1)
    seqs[1][-1] = 11  # copy on write replaced the partial block
    assert step(bridge, tables, seqs) == (padded(seqs), 1)


def test_random_growth_replacement_preemption_and_turnover_always_gather_the_step_tables():
    rng = random.Random(5)
    bridge, tables = Bridge(CPU), DeviceBlockTables(CPU, 12)
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not live:
            live[next_id] = [rng.randrange(64) for _ in range(rng.randint(1, 4))]
            next_id += 1
        elif action < 0.25:
            del live[rng.choice(list(live))]  # finished: its row frees
        elif action < 0.3:
            live[rng.choice(list(live))].clear()  # preempted: its blocks are gone, to be refilled
        for table in live.values():
            if not table or (rng.random() < 0.3 and len(table) < 12):
                table.append(rng.randrange(64))
            elif rng.random() < 0.1:
                table[-1] = rng.randrange(64)
        scheduled = {seq_id: table for seq_id, table in live.items() if rng.random() < 0.9 and table}
        if scheduled:
            assert step(bridge, tables, scheduled)[0] == padded(scheduled)


def test_rows_grow_with_the_most_sequences_a_step_has_not_with_how_many_ever_came():
    bridge, tables = Bridge(CPU), DeviceBlockTables(CPU, 4)
    step(bridge, tables, {seq_id: [seq_id % 7] for seq_id in range(20)})
    assert tables.tables.shape[0] == 32
    for first in range(20, 200, 20):  # a new batch each step: the rows of the last are free again
        seqs = {seq_id: [seq_id % 7] for seq_id in range(first, first + 20)}
        assert step(bridge, tables, seqs)[0] == padded(seqs)
    assert tables.tables.shape[0] == 32


# ----- in a running engine: the tables every step's attention reads are exactly the host's -----------


def checked_engine(**config) -> tuple[LLMEngine, list[int]]:
    """An engine whose every step asserts that the tables gathered on the device are the step's host tables
    (as they were when the step was packed) and that every device row equals its mirror. Returns the
    engine and a cell counting the steps checked."""
    config = {"block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 64, "cuda_graphs": False} | config
    llm = LLMEngine(tiny_model_dir(), EngineConfig(**config))
    checked = [0]
    run = llm.runner.run

    def checking_run(lists, *arguments):
        width = max(map(len, lists.block_tables))
        expected = [table + [-1] * (width - len(table)) for table in lists.block_tables]  # copies, taken now
        result = run(lists, *arguments)
        tables = llm.runner.tables
        assert tables.gathered.tolist() == expected
        for row, held in enumerate(tables.mirror):
            assert tables.tables[row, : len(held)].tolist() == held
            assert (tables.tables[row, len(held):] == -1).all()
        checked[0] += 1
        return result

    llm.runner.run = checking_run
    return llm, checked


def tokens_of(llm: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in output.outputs] for output in llm.generate(prompts, params)]


@pytest.mark.parametrize("overlapped", [False, True])
def test_forks_copy_on_write_preemption_and_row_turnover_keep_the_device_tables_exact(overlapped):
    # Prompts end inside a block, so forked samples share a partial block and copy it on their first
    # write; a pool of 14 blocks preempts and re-admits; more requests than rows reuse freed rows.
    prompts = random_prompts(10, 3, 9, seed=71)
    params = [greedy(length, n=1 + index % 3) for index, length in enumerate(random_lengths(10, 4, 14, seed=72))]
    llm, checked = checked_engine(num_blocks=14, async_scheduling=overlapped)
    tokens = tokens_of(llm, prompts, params)
    assert llm.scheduler.num_preemptions > 0
    assert checked[0] > 20
    roomy = LLMEngine(tiny_model_dir(), EngineConfig(block_size=4, cuda_graphs=False, async_scheduling=False))
    assert tokens == tokens_of(roomy, prompts, params)


def test_a_steady_decode_step_reuses_the_gathered_tables_only_while_nothing_changed():
    llm, checked = checked_engine(num_blocks=64, async_scheduling=False)
    for prompt in random_prompts(3, 5, 5, seed=73):
        llm.add_request(prompt, greedy(12))
    plans = []
    pack = DeviceBlockTables.pack

    def recording_pack(self, *arguments):
        plans.append(pack(self, *arguments))
        return plans[-1]

    DeviceBlockTables.pack = recording_pack
    try:
        while llm.has_unfinished():
            llm.step()
    finally:
        DeviceBlockTables.pack = pack
    # Prompts of 5 with blocks of 4: a new block at positions 8 and 12; other decode steps change nothing.
    assert [plan.unchanged for plan in plans[1:]] == [position % 4 != 0 for position in range(5, 16)]
    assert checked[0] == len(plans) == 12


def test_a_step_packed_but_never_run_leaves_no_row_the_mirror_misjudges():
    bridge, tables = Bridge(CPU), DeviceBlockTables(CPU, 6)
    assert step(bridge, tables, {1: [4, 5]})[1] == 2
    failed = bridge.upload()  # a step that fails after packing: its diff never reaches the device rows
    tables.pack(failed, [1, 2], [[4, 5, 6], [7]])
    assert tables.unapplied == [0, 1]
    seqs = {1: [4, 5, 6], 2: [7]}
    assert step(bridge, tables, seqs)[0] == padded(seqs)
    assert step(bridge, tables, seqs)[1] == 0 and tables.unapplied == []
