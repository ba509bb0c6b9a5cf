"""Audit sinks: JSON lines off the caller's thread, one-second durability, drops instead of blocking."""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from audit import (
    AuditSchemaError,
    AuditSinkError,
    BlocksZeroed,
    EventsDropped,
    JsonLinesSink,
    MemorySink,
    NodeStopped,
    NullSink,
    open_sink,
)
from audit.records import read_audit_files
from audit.sink import SINK_FORMS
from tests.conftest import HANG_S, REPO_ROOT
from tests.test_audit_events import NODE_A, sample_events


def test_json_lines_file_round_trip(tmp_path):
    path = tmp_path / "node.jsonl"
    with JsonLinesSink(path, clock=lambda: 1_700_000_000.9) as sink:
        for event in sample_events():
            sink.emit(event)
    lines = path.read_text(encoding="ascii").splitlines()
    assert len(lines) == len(sample_events())
    assert all(json.loads(line)["ts"] == 1_700_000_000 for line in lines)
    log = read_audit_files([path])
    assert [record.event for record in log.records] == sample_events()
    assert log.truncated_tails == 0


def test_audit_files_are_owner_only(tmp_path):
    path = tmp_path / "node.jsonl"
    JsonLinesSink(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_emission_validates_again(tmp_path):
    event = NodeStopped(NODE_A, "shutdown")
    object.__setattr__(event, "reason", "a prompt")
    for sink in (JsonLinesSink(io.StringIO()), MemorySink(), NullSink()):
        with pytest.raises(AuditSchemaError):
            sink.emit(event)
        with pytest.raises(AuditSchemaError):
            sink.emit({"kind": "node_stopped"})  # type: ignore[arg-type]
        sink.close()


def test_a_crash_loses_nothing_the_writer_flushed_on_its_own(tmp_path):
    """A process that never flushes nor closes its sink, killed by SIGKILL once its writer thread has put
    every event in the file: all of them are on disk.

    The process waits for its writer instead of sleeping past the one-second interval, so a slow or
    loaded machine (a late writer thread, a slow fsync) cannot fail this test; a writer that never
    flushes by itself still does (exit status 3, not SIGKILL)."""
    path = tmp_path / "crash.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from audit import JsonLinesSink, BlocksZeroed
        sink = JsonLinesSink({str(path)!r})
        for step in range(50):
            sink.emit(BlocksZeroed({NODE_A!r}, step=step, blocks=4, residue_blocks=0))
        deadline = time.monotonic() + {HANG_S}
        while not os.path.exists({str(path)!r}) or open({str(path)!r}).read().count("\\n") < 50:
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, timeout=HANG_S + 60)
    assert result.returncode == -9, "the writer did not flush the events by itself"
    steps = [record.event.step for record in read_audit_files([path]).records]
    assert steps == list(range(50))


class BlockedStream(io.StringIO):
    """A stream whose writes wait until released: a stuck disk or a full pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_a_full_sink_drops_and_counts_instead_of_blocking():
    stream = BlockedStream()
    sink = JsonLinesSink(stream, queue_size=10)
    emitter = threading.Thread(target=lambda: [
        sink.emit(BlocksZeroed(NODE_A, step=step, blocks=1, residue_blocks=0)) for step in range(200)])
    emitter.start()
    emitter.join(timeout=HANG_S)
    assert not emitter.is_alive(), "emit blocked on a stuck sink"
    # The writer holds at most one event while stuck; the queue holds ten.
    assert 189 <= sink.dropped <= 190
    stream.release.set()
    sink.flush()
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    written = [record for record in records if record["kind"] == "blocks_zeroed"]
    drops = [record for record in records if record["kind"] == EventsDropped.kind]
    assert len(written) + sink.dropped == 200
    assert sum(record["dropped"] for record in drops) == sink.dropped
    sink.close()


def test_flush_writes_everything_emitted_so_far():
    stream = io.StringIO()
    sink = JsonLinesSink(stream)
    sink.emit(NodeStopped(NODE_A, "shutdown"))
    sink.flush()
    assert json.loads(stream.getvalue())["kind"] == "node_stopped"
    sink.close()
    with pytest.raises(AuditSinkError):
        sink.emit(NodeStopped(NODE_A, "shutdown"))


def test_flush_interval_cannot_exceed_one_second():
    with pytest.raises(AuditSinkError):
        JsonLinesSink(io.StringIO(), flush_interval_s=5)


def test_open_sink_specs(tmp_path, capsys):
    assert isinstance(open_sink("none"), NullSink)
    path = tmp_path / "audit.jsonl"
    file_sink = open_sink(f"file:{path}")
    file_sink.emit(NodeStopped(NODE_A, "shutdown"))
    file_sink.close()
    assert json.loads(path.read_text())["node_id"] == NODE_A
    stdout_sink = open_sink("stdout")
    stdout_sink.emit(NodeStopped(NODE_A, "policy_violation"))
    stdout_sink.close()
    assert json.loads(capsys.readouterr().out)["reason"] == "policy_violation"


def test_open_sink_accepts_the_policys_forms(tmp_path, capsys):
    """`audit.sink` in a policy is `stderr` or `jsonl:PATH`; both open, so a node can honour it."""
    path = tmp_path / "policy-audit.jsonl"
    file_sink = open_sink(f"jsonl:{path}")
    file_sink.emit(NodeStopped(NODE_A, "shutdown"))
    file_sink.close()
    assert json.loads(path.read_text())["node_id"] == NODE_A
    stderr_sink = open_sink("stderr")
    stderr_sink.emit(NodeStopped(NODE_A, "policy_violation"))
    stderr_sink.close()
    captured = capsys.readouterr()
    assert captured.out == "" and json.loads(captured.err)["reason"] == "policy_violation"


def test_every_shipped_policys_sink_is_a_form_open_sink_accepts(tmp_path):
    from policy import shipped_policy
    from policy.shipped import SHIPPED_NAMES
    from tests.policy_support import filled_strict

    for name in SHIPPED_NAMES:
        # strict loads only with its transparency keys filled; its audit sink is the file's own
        sink = (filled_strict() if name == "strict" else shipped_policy(name)).audit.sink
        kind, _, path = sink.partition(":")
        spec = f"{kind}:{tmp_path / 'audit.jsonl'}" if path else sink  # the path itself may not exist here
        open_sink(spec).close()


@pytest.mark.parametrize("spec", ["", "file:", "jsonl:", "syslog", "http://collector.example/prompt"])
def test_bad_sink_specs_are_refused_without_echo(spec):
    with pytest.raises(AuditSinkError) as caught:
        open_sink(spec)
    assert str(caught.value) == SINK_FORMS


def test_unopenable_file_is_a_sink_error(tmp_path):
    with pytest.raises(AuditSinkError, match="cannot open"):
        JsonLinesSink(tmp_path / "missing-dir" / "audit.jsonl")


def test_memory_sink_keeps_records_and_events():
    sink = MemorySink(clock=lambda: 42.7)
    for event in sample_events():
        sink.emit(event)
    assert sink.events == sample_events()
    assert [record["ts"] for record in sink.records] == [42] * len(sample_events())
    assert [record.event for record in sink.audit_records] == sample_events()


def test_reader_skips_a_line_cut_by_a_crash_but_refuses_corruption(tmp_path):
    path = tmp_path / "cut.jsonl"
    with JsonLinesSink(path) as sink:
        sink.emit(NodeStopped(NODE_A, "shutdown"))
    with path.open("a") as handle:
        handle.write('{"schema":"veil.audit/1","kind":"node_st')
    log = read_audit_files([path])
    assert len(log.records) == 1 and log.truncated_tails == 1
    with path.open("a") as handle:
        handle.write('\n{"schema":"veil.audit/1"}\n')
    with pytest.raises(AuditSchemaError, match="line 2"):
        read_audit_files([path])


def test_reader_refuses_non_ascii_files(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("une requête\n", encoding="utf-8")
    with pytest.raises(AuditSchemaError) as caught:
        read_audit_files([path])
    assert "requête" not in str(caught.value)


def test_reader_needs_files():
    with pytest.raises(Exception, match="no audit files"):
        read_audit_files([])
