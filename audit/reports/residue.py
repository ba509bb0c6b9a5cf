"""`veil audit report residue`: every zeroing batch accounted for, every residue check shown.

Input: node audit files (BlocksZeroed, RequestFinished, NodeStarted and
EventsDropped events). Red lines, each of which makes the command fail:

* a zeroing batch whose residue check found freed blocks that are not all zero;
* a node that zeroed fewer blocks than its successful requests must have held
  (each ok request stores at least ceil(prompt tokens / block size) KV blocks,
  with the prompt counted at its bucket's lower bound, so the bound is safe).

Warnings (shown, not failing): dropped events (the accounting is then
incomplete), zeroing batches out of step order within one node run, and files
whose last line was cut by a crash.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from audit.buckets import token_bucket_lower_bound
from audit.events import (
    AuditRecord,
    BlocksZeroed,
    EventsDropped,
    NodeStarted,
    RequestFinished,
    RequestStatus,
)
from audit.errors import AuditReportError
from audit.reports.document import Document, Table, WrittenReport
from audit.reports.plots import new_figure, save_png, short_ids

DEFAULT_BLOCK_SIZE = 16
BLOCKS_PNG = "residue_blocks.png"


@dataclass(slots=True)
class NodeAccount:
    """Zeroing and request totals of one node over all its runs in the files."""

    node_id: str
    runs: int = 0
    batches: int = 0
    blocks_zeroed: int = 0
    residue_blocks: int = 0
    requests: int = 0
    ok_requests: int = 0
    min_blocks_held: int = 0  # lower bound on blocks the ok requests stored
    out_of_order_batches: int = 0
    last_step: int = -1

    @property
    def shortfall(self) -> int:
        """Blocks that finished requests must have held but no zeroing batch accounts for."""
        return max(0, self.min_blocks_held - self.blocks_zeroed)


@dataclass(frozen=True, slots=True)
class ResidueBatch:
    """A zeroing batch whose residue check found non-zero freed blocks."""

    ts: int
    node_id: str
    step: int
    blocks: int
    residue_blocks: int


@dataclass(slots=True)
class ResidueReport:
    """Everything the residue report states, before rendering."""

    block_size: int
    nodes: dict[str, NodeAccount] = field(default_factory=dict)
    residue_batches: list[ResidueBatch] = field(default_factory=list)
    dropped_events: int = 0
    truncated_tails: int = 0

    @property
    def total_batches(self) -> int:
        return sum(node.batches for node in self.nodes.values())

    @property
    def total_blocks(self) -> int:
        return sum(node.blocks_zeroed for node in self.nodes.values())

    @property
    def total_residue(self) -> int:
        return sum(node.residue_blocks for node in self.nodes.values())

    @property
    def passed(self) -> bool:
        """False when any freed block kept data or any node's zeroing falls short."""
        return self.total_residue == 0 and not any(node.shortfall for node in self.nodes.values())


def build_residue_report(
    records: Iterable[AuditRecord], *, block_size: int = DEFAULT_BLOCK_SIZE, truncated_tails: int = 0
) -> ResidueReport:
    """Account for every zeroing batch and residue check in `records` (in time order)."""
    report = ResidueReport(block_size=block_size, truncated_tails=truncated_tails)
    for record in records:
        event = record.event
        if isinstance(event, EventsDropped):
            report.dropped_events += event.dropped
        elif isinstance(event, NodeStarted):
            account = _account(report, event.node_id)
            account.runs += 1
            account.last_step = -1  # steps count from zero again in a new process
        elif isinstance(event, BlocksZeroed):
            _add_batch(report, record.ts, event)
        elif isinstance(event, RequestFinished):
            _add_request(report, event)
    if not any(account.batches or account.requests for account in report.nodes.values()):
        raise AuditReportError("no blocks_zeroed or request_finished events; pass the nodes' audit files")
    return report


def _account(report: ResidueReport, node_id: str) -> NodeAccount:
    account = report.nodes.get(node_id)
    if account is None:
        account = report.nodes[node_id] = NodeAccount(node_id)
    return account


def _add_batch(report: ResidueReport, ts: int, event: BlocksZeroed) -> None:
    account = _account(report, event.node_id)
    account.batches += 1
    account.blocks_zeroed += event.blocks
    account.residue_blocks += event.residue_blocks
    if event.step <= account.last_step:
        account.out_of_order_batches += 1
    account.last_step = max(account.last_step, event.step)
    if event.residue_blocks:
        report.residue_batches.append(ResidueBatch(ts, event.node_id, event.step, event.blocks, event.residue_blocks))


def _add_request(report: ResidueReport, event: RequestFinished) -> None:
    account = _account(report, event.node_id)
    account.requests += 1
    if event.status is RequestStatus.OK:
        account.ok_requests += 1
        prompt_tokens = token_bucket_lower_bound(event.prompt_tokens_bucket)
        account.min_blocks_held += max(1, math.ceil(prompt_tokens / report.block_size))


def write_residue_report(report: ResidueReport, out_dir: Path) -> WrittenReport:
    """Write residue.md, residue.html and the PNG plot into `out_dir` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    image = _plot_blocks(report, out_dir / BLOCKS_PNG)
    markdown, html = _document(report, image).write(out_dir, "residue")
    return WrittenReport(markdown=markdown, html=html, images=(image,), passed=report.passed)


def _document(report: ResidueReport, image: Path) -> Document:
    doc = Document("Veil residue report")
    if report.passed:
        doc.verdict(f"Zero residue: {report.total_batches} zeroing batches, {report.total_blocks} freed blocks "
                    f"zeroed, no freed block kept data, and every node's zeroing covers its finished requests.",
                    passed=True)
    for batch in report.residue_batches:
        doc.red_line(f"node {batch.node_id}, step {batch.step} (ts {batch.ts}): {batch.residue_blocks} of "
                     f"{batch.blocks} freed blocks were not zero after scrubbing.")
    for account in report.nodes.values():
        if account.shortfall:
            doc.red_line(f"node {account.node_id}: its ok requests held at least {account.min_blocks_held} "
                         f"blocks but only {account.blocks_zeroed} were zeroed ({account.shortfall} unaccounted).")
    _warnings(doc, report)
    _nodes_section(doc, report, image)
    _method_section(doc, report)
    return doc


def _warnings(doc: Document, report: ResidueReport) -> None:
    if report.dropped_events:
        doc.warning(f"{report.dropped_events} audit events were dropped by full sinks: batches may be missing, "
                    "so this accounting is incomplete.")
    for account in report.nodes.values():
        if account.out_of_order_batches:
            doc.warning(f"node {account.node_id}: {account.out_of_order_batches} zeroing batch(es) out of step "
                        "order within one run (duplicated or reordered events).")
        if account.batches and not account.runs:
            doc.warning(f"node {account.node_id}: zeroing batches without a node_started event in these files.")
    if report.truncated_tails:
        doc.warning(f"{report.truncated_tails} file(s) ended in a line cut short by a crash; it was skipped.")


def _nodes_section(doc: Document, report: ResidueReport, image: Path) -> None:
    rows, red = [], set()
    for index, account in enumerate(report.nodes.values()):
        if account.residue_blocks or account.shortfall:
            red.add(index)
        rows.append((account.node_id, str(account.runs), str(account.requests), str(account.ok_requests),
                     str(account.batches), str(account.blocks_zeroed), str(account.min_blocks_held),
                     str(account.residue_blocks)))
    doc.heading("Per node")
    doc.table(Table(("node", "runs", "requests", "ok", "zeroing batches", "blocks zeroed",
                     "min. blocks held by ok requests", "residue blocks"), tuple(rows), frozenset(red)))
    doc.image(image, "blocks zeroed and residue per node")


def _method_section(doc: Document, report: ResidueReport) -> None:
    doc.heading("Method")
    doc.paragraph("Each engine step zeroes the KV blocks freed in it as one batch; a node reports its tally of "
                  "such batches (at least a second and several requests' worth) as a blocks_zeroed event, "
                  "and residue_blocks counts freed blocks the residue checks still found "
                  "non-zero. Any residue is a red line. A node's zeroed blocks must also cover the blocks its "
                  f"successful requests stored: at least ceil(prompt tokens / {report.block_size}) per request, "
                  "prompts counted at their bucket's lower bound.")


def _plot_blocks(report: ResidueReport, path: Path) -> Path:
    accounts = list(report.nodes.values())
    label = short_ids(account.node_id for account in accounts)
    positions = range(len(accounts))
    figure = new_figure(max(8.0, 0.6 * len(accounts)), 4.0)
    axes = figure.add_subplot()
    axes.bar([p - 0.2 for p in positions], [a.blocks_zeroed for a in accounts], width=0.4,
             color="#36c", label="blocks zeroed")
    axes.bar([p + 0.2 for p in positions], [a.min_blocks_held for a in accounts], width=0.4,
             color="#8aa", label="min. blocks held by ok requests")
    axes.bar(list(positions), [a.residue_blocks for a in accounts], width=0.8, color="#c00",
             label="residue blocks (must be 0)")
    axes.set_xticks(list(positions), [label[a.node_id] for a in accounts], rotation=60, fontsize=7)
    axes.set_ylabel("KV blocks")
    axes.set_title(f"Zeroed blocks per node: {report.total_residue} residue")
    axes.legend()
    return save_png(figure, path)
