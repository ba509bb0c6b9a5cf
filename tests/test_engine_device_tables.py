"""Block tables kept on the device: each step uploads only the entries that changed, and the device rows
always gather to exactly the step's tables, whatever the order of growth, copy on write and preemption."""

from __future__ import annotations

import random

import torch

from engine.bridge import Bridge
from engine.device_tables import DeviceBlockTables

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
