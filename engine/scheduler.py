"""FCFS continuous batching with chunked prefill under a per-step token budget.

Running sequences go first, in the arrival order of their requests (a readmitted one takes its place
again); waiting ones are admitted while the budget and the KV pool allow. When blocks run out, the
youngest request is preempted by recompute: its blocks are freed (and zeroed) and it goes back to the
front of the queue. Nothing is ever swapped out.

Recompute makes a bad victim costly: every token a preempted sequence had is computed again. So the
victim is the youngest request, never one readmitted last (that would preempt the oldest requests again
and again), and a waiting sequence is admitted only if the pool holds the whole of its prefill beside
what the running prefills still need, not just its first chunk: one admitted on a chunk's room would
be preempted before its prefill ends and the chunks done be lost.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` new tokens of `seq`, starting at `seq.num_computed_tokens`, and any drafts after them."""

    seq: Sequence
    num_tokens: int
    # Speculative decoding: tokens proposed to follow the sequence's last one, verified by this step's
    # picks (`engine.speculative`); they take KV slots and query positions but are no part of `seq`.
    # No drafts: an empty tuple, shared, where a list per chunk would be made for nothing.
    draft: list[int] | tuple[()] = ()

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last position picks a token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


# (sequence, step tokens left beside its own) -> drafts to follow its last token this step.
Drafter = Callable[[Sequence, int], list[int]]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, drafter: Drafter | None = None) -> None:
        self.drafter = drafter
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order: the youngest last
        self._arrivals = itertools.count()
        # Admitted sequences whose prefill is not done: each with the tokens it had when admitted, all of
        # which the pool must still hold (`_admit_waiting`).
        self._prefilling: dict[Sequence, int] = {}
        self.num_preemptions = 0
        # Tokens computed and then thrown away by preemptions: each is computed again (recompute).
        self.num_recomputed_tokens = 0
        # Each running sample's decode chunk (one token, no drafts), kept while it runs: chunks are never
        # changed once made, and a decode step would otherwise make one per sample.
        self._decode_chunks: dict[Sequence, ScheduledChunk] = {}

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, sibling: Sequence) -> None:
        """A forked sample joins its siblings directly: its prompt is already computed. It arrived with them."""
        seq.arrival = sibling.arrival
        self._run(seq)

    def _run(self, seq: Sequence) -> None:
        """`seq` runs, in its request's place among the running (after its siblings)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort_right(self.running, seq, key=_arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks, budget, preempted = self._schedule_running(budget)
        if not preempted:
            chunks += self._admit_waiting(budget)
        return chunks

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledChunk], int, bool]:
        chunks: list[ScheduledChunk] = []
        preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            if self.drafter is None:
                index, budget = self._steady_decodes(chunks, index, budget)
                if index == len(self.running) or not budget:
                    break
            seq = self.running[index]
            if not seq.can_grow:  # its pending token is its last: it ends when that is read
                index += 1
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens):
                break  # seq was the latest arrival and had to be preempted itself
            draft = self._draft(seq, num_tokens, budget, later=len(self.running) - index - 1)
            self.block_manager.reserve(seq, num_tokens + len(draft))
            chunks.append(ScheduledChunk(seq, num_tokens, draft))
            budget -= num_tokens + len(draft)
            index += 1
        return chunks, budget, self.num_preemptions > preemptions_before

    def _steady_decodes(self, chunks: list[ScheduledChunk], index: int, budget: int) -> tuple[int, int]:
        """Schedules running sequences from `index` on while each decodes one token into a slot it holds
        already or can take without a preemption (most sequences of most steps). Returns the index
        of the first one that needs more, for the general loop, and the budget left. Properties are
        spelled out and a sample's decode chunk is made once: this loop runs for every sample of every step."""
        reserve, made = self.block_manager.reserve_decode, self._decode_chunks
        for seq in self.running[index:] if index else self.running:
            if not budget:
                break
            outputs = len(seq.output_token_ids) + (seq.pending_row is not None)  # `num_output_tokens`
            if outputs < seq.max_tokens:  # else its pending token is its last: it ends when that is read
                if len(seq.prompt_token_ids) + outputs - seq.num_computed_tokens != 1 or not reserve(seq):
                    break
                chunk = made.get(seq)
                if chunk is None:
                    chunk = made[seq] = ScheduledChunk(seq, 1)
                chunks.append(chunk)
                budget -= 1
            index += 1
        return index, budget

    def _draft(self, seq: Sequence, num_tokens: int, budget: int, later: int) -> list[int]:
        """Drafts for a decoding sequence, where the budget and free blocks allow.

        Not at another's expense: their slots must leave a block free for each of the `later` running
        sequences, so that drafts do not make the scheduler preempt a decoding one.
        """
        if self.drafter is None or num_tokens != 1 or seq.num_uncomputed_tokens != 1 or seq.pooling is not None:
            return []  # an embedding's last prompt token is no decode: it picks nothing to verify
        draft = self.drafter(seq, budget - 1)
        if draft and not self.block_manager.can_reserve(seq, 1 + len(draft), spare=later):
            return []
        return draft

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempts the youngest requests until `seq` fits; False if `seq` itself had to go."""
        while not self.block_manager.can_reserve(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending_row is not None:
                break  # preempted while its token was in flight: recomputed once that token is read
            # The whole prefill must fit, beside what the prefills admitted before still need.
            if not self.block_manager.can_reserve(seq, seq.num_uncomputed_tokens, spare=self._blocks_promised()):
                break
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            self.waiting.popleft()
            self.block_manager.reserve(seq, num_tokens)
            self._run(seq)
            if num_tokens < seq.num_uncomputed_tokens:
                self._prefilling[seq] = seq.num_tokens
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def _blocks_promised(self) -> int:
        """Blocks the running prefills still need to reach the tokens they had when admitted (those done or
        ended are forgotten here)."""
        blocks_for, promised = self.block_manager.blocks_for, 0
        for seq, tokens in list(self._prefilling.items()):
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens >= tokens:
                del self._prefilling[seq]
            else:
                promised += max(blocks_for(tokens) - len(seq.block_table), 0)
        return promised

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._decode_chunks.pop(seq, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out and frees its blocks."""
        self._decode_chunks.pop(seq, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)


def _arrival(seq: Sequence) -> int:
    return seq.arrival
