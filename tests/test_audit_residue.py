"""The residue report: every zeroing batch accounted for, any non-zero freed block a red line."""

from __future__ import annotations

import pytest

from audit import (
    AuditReportError,
    BlocksZeroed,
    EventsDropped,
    MemorySink,
    NodeStarted,
    RequestFinished,
    bucket_latency_ms,
    bucket_tokens,
)
from audit.reports.residue import build_residue_report, write_residue_report
from tests.test_audit_cli import veil_audit, write_events
from tests.test_audit_events import NODE_A, NODE_B, POLICY
from tests.test_audit_routes import assert_png


def request(node_id: str, prompt_tokens: int, status: str = "ok") -> RequestFinished:
    return RequestFinished(node_id, status, bucket_tokens(prompt_tokens), bucket_tokens(9),
                           bucket_latency_ms(120), bucket_latency_ms(15))


def healthy_node(node_id: str) -> list:
    # Two requests of 40 and 100 prompt tokens: at least 1 + 4 = 5 blocks of 16 (bucket lower bounds 16 and 64).
    return [NodeStarted(node_id, POLICY, "0.1.0", "sim"),
            request(node_id, 40), BlocksZeroed(node_id, step=3, blocks=3, residue_blocks=0),
            request(node_id, 100), BlocksZeroed(node_id, step=9, blocks=7, residue_blocks=0),
            request(node_id, 0, status="client_error")]


def test_healthy_fleet_shows_zero_residue(tmp_path):
    write_events(tmp_path / "a.jsonl", healthy_node(NODE_A))
    write_events(tmp_path / "b.jsonl", healthy_node(NODE_B))
    out_dir = tmp_path / "report"
    assert veil_audit(["report", "residue", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                       "--out", str(out_dir)]) == 0
    markdown = (out_dir / "residue.md").read_text()
    assert "✓ Zero residue: 4 zeroing batches, 20 freed blocks zeroed" in markdown
    assert "RED LINE" not in markdown and 'class="red"' not in (out_dir / "residue.html").read_text()
    assert_png(out_dir / "residue_blocks.png")
    assert "data:image/png;base64," in (out_dir / "residue.html").read_text()


def test_any_non_zero_freed_block_is_a_red_line(tmp_path):
    events = healthy_node(NODE_A) + [BlocksZeroed(NODE_A, step=12, blocks=5, residue_blocks=2)]
    write_events(tmp_path / "a.jsonl", events)
    out_dir = tmp_path / "report"
    assert veil_audit(["report", "residue", str(tmp_path / "a.jsonl"), "--out", str(out_dir)]) == 1
    markdown = (out_dir / "residue.md").read_text()
    assert f"**✗ RED LINE: node {NODE_A}, step 12 (ts 1700000000): 2 of 5 freed blocks were not zero" in markdown
    assert "Zero residue" not in markdown
    html = (out_dir / "residue.html").read_text()
    assert '<p class="red">' in html and '<tr class="red">' in html


def test_zeroing_that_does_not_cover_finished_requests_is_a_red_line(tmp_path):
    sink = MemorySink()
    for event in [request(NODE_A, 300), request(NODE_A, 300), BlocksZeroed(NODE_A, step=1, blocks=20, residue_blocks=0)]:
        sink.emit(event)
    report = build_residue_report(sink.audit_records)
    account = report.nodes[NODE_A]
    assert account.min_blocks_held == 32  # 2 × ceil(256 / 16)
    assert account.shortfall == 12 and not report.passed
    assert "12 unaccounted" in _markdown(report, tmp_path)


def test_block_size_changes_the_bound():
    sink = MemorySink()
    for event in [request(NODE_A, 300), BlocksZeroed(NODE_A, step=1, blocks=8, residue_blocks=0)]:
        sink.emit(event)
    assert not build_residue_report(sink.audit_records, block_size=16).passed  # needs 16
    assert build_residue_report(sink.audit_records, block_size=32).passed  # needs 8


def test_warnings_for_drops_reordering_and_unknown_nodes(tmp_path):
    sink = MemorySink()
    for event in [BlocksZeroed(NODE_A, step=5, blocks=1, residue_blocks=0),
                  BlocksZeroed(NODE_A, step=5, blocks=1, residue_blocks=0),  # the same step twice
                  EventsDropped(dropped=4),
                  NodeStarted(NODE_B, POLICY, "0.1.0", "sim"),
                  BlocksZeroed(NODE_B, step=8, blocks=1, residue_blocks=0),
                  NodeStarted(NODE_B, POLICY, "0.1.0", "sim"),  # a restart: steps count from zero again
                  BlocksZeroed(NODE_B, step=1, blocks=1, residue_blocks=0)]:
        sink.emit(event)
    report = build_residue_report(sink.audit_records)
    assert report.passed and report.dropped_events == 4
    assert report.nodes[NODE_A].out_of_order_batches == 1
    assert report.nodes[NODE_B].out_of_order_batches == 0 and report.nodes[NODE_B].runs == 2
    markdown = _markdown(report, tmp_path)
    assert "4 audit events were dropped" in markdown
    assert f"node {NODE_A}: 1 zeroing batch(es) out of step order" in markdown
    assert f"node {NODE_A}: zeroing batches without a node_started event" in markdown


def test_no_node_events_is_an_input_error(tmp_path):
    with pytest.raises(AuditReportError, match="nodes' audit files"):
        build_residue_report([])
    write_events(tmp_path / "empty.jsonl", [EventsDropped(dropped=1)])
    assert veil_audit(["report", "residue", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "r")]) == 2


def _markdown(report, out_dir) -> str:
    return write_residue_report(report, out_dir).markdown.read_text()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def run_audited_engine(model_dir, *, skip_zeroing: bool) -> MemorySink:
    """A real engine serving four requests, audited the way a node audits each step."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_blocks=64, unsafe_skip_zeroing=skip_zeroing))
    engine.block_manager.track_scrubbed()
    sink = MemorySink()
    sink.emit(NodeStarted(NODE_A, POLICY, "0.1.0", "sim"))
    for prompt in ["Hello, world! " * 3, "The quick brown fox jumps over the lazy dog. " * 6, "0123456789", "Veil"]:
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    step = 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.metrics is not None:
                sink.emit(RequestFinished(NODE_A, "ok", bucket_tokens(delta.metrics.prompt_tokens),
                                          bucket_tokens(delta.metrics.output_tokens), "0-9ms", "0-9ms"))
        zeroed = engine.block_manager.take_recently_scrubbed()
        if zeroed:
            residue = engine.runner.find_residue(zeroed)
            sink.emit(BlocksZeroed(NODE_A, step=step, blocks=len(zeroed), residue_blocks=len(residue)))
        step += 1
    return sink


def test_a_real_engine_zeroing_on_free_shows_zero_residue(tiny_model, tmp_path):
    sink = run_audited_engine(tiny_model, skip_zeroing=False)
    report = build_residue_report(sink.audit_records)
    account = report.nodes[NODE_A]
    assert account.ok_requests == 4 and account.batches >= 1
    assert account.blocks_zeroed >= account.min_blocks_held > 0
    assert report.passed and report.total_residue == 0
    assert write_residue_report(report, tmp_path).passed


def test_a_real_engine_that_skips_zeroing_is_caught(tiny_model, tmp_path):
    report = build_residue_report(run_audited_engine(tiny_model, skip_zeroing=True).audit_records)
    assert report.total_residue > 0 and not report.passed
    written = write_residue_report(report, tmp_path)
    assert not written.passed
    assert "RED LINE" in written.markdown.read_text()
