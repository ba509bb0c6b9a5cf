"""Paged KV bookkeeping in block ids and reference counts only; tensors live in the model runner.

Zero on free: a block whose reference count drops to zero is not reusable until `scrub` has
overwritten its K and V in every layer. Freed blocks are scrubbed together, in one batched call,
at the end of each engine step (or earlier, if an allocation needs them first).

Copy on write is eager: the shared block is copied the moment a sample takes its private block,
while the source is still referenced. A deferred copy could read a source that a preemption later
in the same step freed, and an allocation then zeroed and handed to another request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.sequence import Sequence

Scrub = Callable[[list[int]], None]
CopyBlock = Callable[[int, int], None]  # (source, destination): K and V of every layer


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, scrub: Scrub, copy: CopyBlock) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._scrub = scrub
        self._copy = copy
        self._free: deque[int] = deque(range(num_blocks))
        self._freed_unscrubbed: list[int] = []
        self._ref_counts = [0] * num_blocks
        self.scrub_calls = 0
        self.blocks_scrubbed = 0
        # Ids zeroed since an observer last took them; kept only once someone asks (the node's audit).
        self.recently_scrubbed: list[int] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can have, scrubbed or about to be."""
        return len(self._free) + len(self._freed_unscrubbed)

    def free_block_ids(self) -> list[int]:
        """Blocks on the free list: every one of them must be all zeros."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, seq: Sequence, num_new_tokens: int, spare: int = 0) -> bool:
        """Whether `seq` can have slots for `num_new_tokens` more tokens and `spare` blocks stay free."""
        return self._blocks_needed(seq, num_new_tokens) + spare <= self.num_free_blocks

    def decode_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s next token has its slot already, in a block of its own: `reserve(seq, 1)` would
        do nothing. True for all but one step in `block_size` of a decoding sequence; the scheduler then
        skips `can_reserve` and `reserve` for it."""
        position = seq.num_computed_tokens
        index = position // self.block_size
        table = seq.block_table
        return index < len(table) and (position % self.block_size == 0 or self._ref_counts[table[index]] == 1)

    def reserve_decode(self, seq: Sequence) -> bool:
        """`reserve(seq, 1)` where it takes no preemption: True once `seq`'s next token has its private slot
        (mostly held already), False, with nothing done, when the free blocks do not allow it."""
        # `can_reserve(seq, 1)` and `reserve(seq, 1)` spelled out: this runs for every sample of every step.
        position = seq.num_computed_tokens
        index = position // self.block_size
        table = seq.block_table
        if index < len(table):
            if position % self.block_size == 0 or self._ref_counts[table[index]] == 1:
                return True  # `decode_fits`
            if not self.num_free_blocks:
                return False
            self._copy_on_write(seq)  # the partial block is shared: a private copy of it
            return True
        needed = index + 1 - len(table)  # one, unless a trim left the table short
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.append(self._take())
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> None:
        """Gives `seq` private slots for its next `num_new_tokens` tokens."""
        self._copy_on_write(seq)
        target = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Lets `child` share every block of `parent` (samples of one request only)."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._ref_counts[block_id] += 1

    def free(self, seq: Sequence) -> None:
        self._release(seq.block_table)
        seq.block_table = []

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks past those `seq`'s computed tokens use: where only its rejected drafts were written.

        They are zeroed with every other freed block; the next step reserves again what it needs.
        """
        keep = self.blocks_for(seq.num_computed_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._freed_unscrubbed.append(block_id)

    def scrub_freed(self) -> int:
        """Zeroes every freed block in one call and returns them to the free list."""
        freed = self._freed_unscrubbed
        if not freed:
            return 0
        self._scrub(freed)
        self._freed_unscrubbed = []
        self._free.extend(freed)
        self.scrub_calls += 1
        self.blocks_scrubbed += len(freed)
        if self.recently_scrubbed is not None:
            self.recently_scrubbed += freed
        return len(freed)

    def track_scrubbed(self) -> None:
        """Starts keeping the ids of zeroed blocks for `take_recently_scrubbed` (the node's audit)."""
        if self.recently_scrubbed is None:
            self.recently_scrubbed = []

    def take_recently_scrubbed(self) -> list[int]:
        """The blocks zeroed since the previous call, for a residue check of exactly those."""
        if self.recently_scrubbed is None:
            return []
        taken, self.recently_scrubbed = self.recently_scrubbed, []
        return taken

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        new_blocks = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(new_blocks, 0) + int(self._needs_copy(seq))

    def _needs_copy(self, seq: Sequence) -> bool:
        # Only a partially filled block shared with a sibling sample can be written to.
        position = seq.num_computed_tokens
        index = position // self.block_size
        if position % self.block_size == 0 or index >= len(seq.block_table):
            return False
        return self._ref_counts[seq.block_table[index]] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        if not self._needs_copy(seq):
            return
        index = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[index]
        private = self._take()
        self._copy(shared, private)  # now: `seq` still holds `shared`, so nothing can have freed it
        self._ref_counts[shared] -= 1
        seq.block_table[index] = private

    def _take(self) -> int:
        if not self._free:
            self.scrub_freed()
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id
