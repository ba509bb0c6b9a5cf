"""Block bookkeeping without a model: reference counts, forks, copy-on-write, and zero on free.

The scrub and copy callables record what they are asked to do, so the tests can check that no freed
block is handed out again before it was scrubbed, that everything freed is scrubbed in one call, and
that a copy on write only ever reads a block some sample still holds.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BLOCK_SIZE = 4


class ScrubRecorder:
    """Stands in for the model runner's zeroing and copying: remembers every call, in order."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.copies: list[tuple[int, int]] = []
        self.events: list[tuple[str, object]] = []  # ("scrub", ids) and ("copy", (source, destination))
        self.manager: BlockManager | None = None

    def __call__(self, block_ids: list[int]) -> None:
        # Every block handed to the scrub must be unreferenced at that moment.
        assert self.manager is not None
        assert all(self.manager.ref_count(b) == 0 for b in block_ids)
        self.calls.append(list(block_ids))
        self.events.append(("scrub", list(block_ids)))

    def copy(self, source: int, destination: int) -> None:
        # The source is shared by the writer and a sibling; the destination is the writer's fresh block.
        assert self.manager is not None
        assert self.manager.ref_count(source) >= 2
        assert self.manager.ref_count(destination) == 1
        assert source not in self.manager.free_block_ids()
        self.copies.append((source, destination))
        self.events.append(("copy", (source, destination)))

    @property
    def scrubbed(self) -> list[int]:
        return [b for call in self.calls for b in call]


def make_manager(num_blocks: int = 8) -> tuple[BlockManager, ScrubRecorder]:
    recorder = ScrubRecorder()
    manager = BlockManager(num_blocks, BLOCK_SIZE, recorder, recorder.copy)
    recorder.manager = manager
    return manager, recorder


_next_id = iter(range(1_000_000))


def make_seq(prompt_len: int) -> Sequence:
    return Sequence(
        seq_id=next(_next_id), request_id="r", sample_index=0, prompt_token_ids=[7] * prompt_len,
        params=SamplingParams(temperature=0.0), seed=None, max_tokens=64,
    )


def prefill(manager: BlockManager, seq: Sequence) -> None:
    manager.reserve(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens


def decode_one(manager: BlockManager, seq: Sequence) -> None:
    seq.append_token(3)
    manager.reserve(seq, 1)
    seq.num_computed_tokens += 1


def fork(manager: BlockManager, parent: Sequence) -> Sequence:
    child = make_seq(parent.num_prompt_tokens)
    child.output_token_ids = list(parent.output_token_ids)
    manager.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def test_reserve_takes_exactly_the_blocks_the_tokens_need():
    manager, _ = make_manager(8)
    seq = make_seq(9)
    assert manager.can_reserve(seq, 9)
    prefill(manager, seq)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert all(manager.ref_count(b) == 1 for b in seq.block_table)
    assert manager.num_free_blocks == 5
    decode_one(manager, seq)  # position 9 still fits in the third block
    decode_one(manager, seq)
    decode_one(manager, seq)
    assert len(seq.block_table) == 3
    decode_one(manager, seq)  # position 12 opens a fourth block
    assert len(seq.block_table) == 4


def test_can_reserve_refuses_more_than_the_pool_holds():
    manager, _ = make_manager(3)
    assert manager.can_reserve(make_seq(12), 12)
    assert not manager.can_reserve(make_seq(13), 13)


def test_freed_blocks_reach_the_free_list_only_through_one_scrub_call():
    manager, recorder = make_manager(8)
    first, second = make_seq(9), make_seq(5)
    prefill(manager, first)
    prefill(manager, second)
    used = set(first.block_table) | set(second.block_table)
    manager.free(first)
    manager.free(second)
    assert first.block_table == [] and second.block_table == []
    assert not used & set(manager.free_block_ids()), "freed blocks were listed free before zeroing"
    assert manager.num_free_blocks == 8  # they count as available to allocation, though
    assert recorder.calls == []

    assert manager.scrub_freed() == len(used)
    assert len(recorder.calls) == 1
    assert sorted(recorder.calls[0]) == sorted(used)
    assert used <= set(manager.free_block_ids())
    assert manager.scrub_calls == 1 and manager.blocks_scrubbed == len(used)
    assert manager.scrub_freed() == 0 and len(recorder.calls) == 1  # nothing freed: no call at all


def test_a_freed_block_is_scrubbed_before_it_is_handed_out_again():
    manager, recorder = make_manager(4)
    hog = make_seq(16)
    prefill(manager, hog)
    freed = list(hog.block_table)
    manager.free(hog)
    newcomer = make_seq(5)
    prefill(manager, newcomer)  # the free list is empty: allocation must scrub first
    assert recorder.calls and sorted(recorder.calls[0]) == sorted(freed)
    assert set(newcomer.block_table) <= set(freed)


def test_fork_shares_blocks_and_only_the_last_free_releases_them():
    manager, recorder = make_manager(8)
    parent = make_seq(8)
    prefill(manager, parent)
    children = [fork(manager, parent) for _ in range(3)]
    assert all(child.block_table == parent.block_table for child in children)
    assert all(manager.ref_count(b) == 4 for b in parent.block_table)
    assert manager.num_free_blocks == 6

    shared = list(parent.block_table)
    manager.free(parent)
    for child in children[:2]:
        manager.free(child)
    manager.scrub_freed()
    assert recorder.calls == [], "a block still used by a sample was scrubbed"
    assert all(manager.ref_count(b) == 1 for b in shared)
    manager.free(children[2])
    manager.scrub_freed()
    assert sorted(recorder.calls[0]) == sorted(shared)


def test_shared_partial_last_block_is_copied_on_write():
    manager, recorder = make_manager(8)
    parent = make_seq(6)  # blocks: [full, partial with 2 of 4 slots used]
    prefill(manager, parent)
    child = fork(manager, parent)
    full, partial = parent.block_table
    # Writing position 6 needs a private copy of the partial block: one more block than the table grows.
    assert manager.can_reserve(child, 1)
    child.append_token(3)
    manager.reserve(child, 1)
    assert child.block_table[0] == full
    assert child.block_table[1] != partial
    assert recorder.copies == [(partial, child.block_table[1])]  # copied at once, not later
    assert manager.ref_count(full) == 2
    assert manager.ref_count(partial) == 1
    assert manager.ref_count(child.block_table[1]) == 1
    # The parent now owns the partial block alone: it writes in place, with no second copy.
    decode_one(manager, parent)
    assert parent.block_table == [full, partial]
    assert len(recorder.copies) == 1


def test_copy_on_write_reads_the_shared_block_before_a_preempted_sibling_frees_it():
    """One step: sample 0 copies the shared block, sample 1 is preempted, a newcomer takes the freed block."""
    manager, recorder = make_manager(3)
    first = make_seq(6)  # a full block and a half-filled one, shared by both samples
    prefill(manager, first)
    second = fork(manager, first)
    first.append_token(3)
    manager.reserve(first, 1)  # copy on write into a private block
    _, shared = second.block_table
    manager.free(second)  # preempted: the shared half-filled block has no holder left
    newcomer = make_seq(4)
    prefill(manager, newcomer)  # the free list is empty: the freed block is zeroed and handed out
    assert newcomer.block_table == [shared]
    copy_at = recorder.events.index(("copy", (shared, first.block_table[1])))
    scrub_at = next(i for i, (kind, ids) in enumerate(recorder.events) if kind == "scrub" and shared in ids)
    assert copy_at < scrub_at, "the shared block was zeroed before its copy was made"


def test_copy_on_write_counts_against_the_pool():
    manager, _ = make_manager(2)
    parent = make_seq(6)
    prefill(manager, parent)
    child = fork(manager, parent)
    child.append_token(3)
    assert not manager.can_reserve(child, 1), "a copy needs a free block, and none is left"


def test_shared_full_blocks_are_not_copied():
    manager, recorder = make_manager(8)
    parent = make_seq(8)  # exactly two full blocks
    prefill(manager, parent)
    child = fork(manager, parent)
    child.append_token(3)
    manager.reserve(child, 1)
    assert child.block_table[:2] == parent.block_table
    assert len(child.block_table) == 3
    assert recorder.copies == []


class BlockManagerMachine(RuleBasedStateMachine):
    """Random prefill, decode, fork, free and scrub sequences against the bookkeeping invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.manager, self.recorder = make_manager(12)
        self.live: list[Sequence] = []
        # Blocks that held data and have not been scrubbed since: none of them may be handed out.
        self.dirty: set[int] = set()
        self.handed_out_dirty: list[int] = []

    def _allocate(self, seq: Sequence, action) -> None:
        before = set(seq.block_table)
        calls_before = len(self.recorder.calls)
        action()
        for call in self.recorder.calls[calls_before:]:
            self.dirty -= set(call)
        new_blocks = set(seq.block_table) - before
        self.handed_out_dirty += sorted(new_blocks & self.dirty)

    @rule(prompt_len=st.integers(1, 20))
    def admit(self, prompt_len: int) -> None:
        seq = make_seq(prompt_len)
        if self.manager.can_reserve(seq, prompt_len):
            self._allocate(seq, lambda: prefill(self.manager, seq))
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(3)
        fits = self.manager.decode_fits(seq)
        if self.manager.can_reserve(seq, 1):
            table, copies = list(seq.block_table), len(self.recorder.copies)
            # The scheduler's steady loop reserves through reserve_decode: the same as reserve(seq, 1).
            write = self._write_one if data.draw(st.booleans()) else self._write_one_decode
            self._allocate(seq, lambda: write(seq))
            # The scheduler skips reserve(seq, 1) when this says so: exactly when it would do nothing.
            assert fits == (seq.block_table == table and len(self.recorder.copies) == copies)
        else:
            assert not fits
            table, free = list(seq.block_table), self.manager.num_free_blocks
            assert not self.manager.reserve_decode(seq)  # it leaves the preemption to the scheduler
            assert (seq.block_table, self.manager.num_free_blocks) == (table, free)
            seq.output_token_ids.pop()  # no room this step; a real scheduler would preempt

    def _write_one(self, seq: Sequence) -> None:
        self.manager.reserve(seq, 1)
        seq.num_computed_tokens += 1

    def _write_one_decode(self, seq: Sequence) -> None:
        assert self.manager.reserve_decode(seq)
        seq.num_computed_tokens += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork_sample(self, data) -> None:
        parent = data.draw(st.sampled_from(self.live))
        self.live.append(fork(self.manager, parent))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        blocks = list(seq.block_table)
        self.manager.free(seq)
        self.dirty |= {b for b in blocks if self.manager.ref_count(b) == 0}

    @rule()
    def end_step(self) -> None:
        calls_before = len(self.recorder.calls)
        self.manager.scrub_freed()
        assert len(self.recorder.calls) - calls_before <= 1
        for call in self.recorder.calls[calls_before:]:
            self.dirty -= set(call)

    @invariant()
    def reference_counts_match_the_tables(self) -> None:
        counts = Counter(b for seq in self.live for b in seq.block_table)
        for block_id in range(self.manager.num_blocks):
            assert self.manager.ref_count(block_id) == counts.get(block_id, 0)

    @invariant()
    def every_block_is_free_or_referenced_never_both(self) -> None:
        free = self.manager.free_block_ids()
        referenced = {b for seq in self.live for b in seq.block_table}
        assert len(free) == len(set(free))
        assert not set(free) & referenced
        assert self.manager.num_free_blocks == self.manager.num_blocks - len(referenced)

    @invariant()
    def no_dirty_block_is_free_or_handed_out(self) -> None:
        assert not self.dirty & set(self.manager.free_block_ids())
        assert self.handed_out_dirty == []

    @invariant()
    def scrub_calls_never_repeat_a_block(self) -> None:
        for call in self.recorder.calls:
            assert len(call) == len(set(call))

    @invariant()
    def each_sequence_owns_enough_blocks(self) -> None:
        for seq in self.live:
            assert len(seq.block_table) == self.manager.blocks_for(seq.num_computed_tokens)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("num_blocks", [1, 5])
def test_every_block_starts_free_and_unreferenced(num_blocks):
    manager, _ = make_manager(num_blocks)
    assert manager.free_block_ids() == list(range(num_blocks))
    assert manager.num_free_blocks == num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(num_blocks))
