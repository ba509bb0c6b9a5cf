"""`veil audit`: the subcommands as registered into a parser, and the summary."""

from __future__ import annotations

import argparse

import pytest

from audit import BlocksZeroed, JsonLinesSink, MemorySink
from audit.cli import parse_capacities, register
from audit.records import AuditLog, read_audit_files
from audit.summary import format_summary, summarize
from tests.test_audit_events import ISSUER_KEY, NODE_A, NODE_B, sample_events


def veil_audit(argv: list[str]) -> int:
    """Run `veil audit ARGV` through the same `register` hook the veil CLI uses."""
    parser = argparse.ArgumentParser(prog="veil")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["audit", *argv])
    return args.handler(args)


def write_events(path, events, clock=lambda: 1_700_000_000.0) -> None:
    with JsonLinesSink(path, clock=clock) as sink:
        for event in events:
            sink.emit(event)


def test_summary_counts_a_fleet(tmp_path, capsys):
    write_events(tmp_path / "a.jsonl", sample_events())
    write_events(tmp_path / "b.jsonl", [BlocksZeroed(NODE_B, step=1, blocks=5, residue_blocks=0)])
    assert veil_audit(["summary", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "2 file(s), 12 events" in out
    assert "KV scrubbing: 2 batches, 17 blocks zeroed, residue: none" in out
    assert "routes: 1 (failover 1) by 1 gateway(s)" in out
    assert "requests: 1 (ok 1)" in out
    assert "dropped events: 3" in out
    assert f"tokens: accepted 41 (key {ISSUER_KEY[:12]} 41); refused 3 (spent 2, wrong_challenge 1)" in out
    assert len(out.splitlines()) <= 24  # one screen


def test_summary_flags_residue():
    sink = MemorySink()
    sink.emit(BlocksZeroed(NODE_A, step=1, blocks=5, residue_blocks=2))
    log = AuditLog(records=tuple(sink.audit_records), files=1, truncated_tails=0)
    text = format_summary(summarize(log))
    assert "residue: 2 blocks  <-- RED LINE" in text


def test_summary_of_unreadable_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert veil_audit(["summary", str(bad)]) == 2
    assert "line 1" in capsys.readouterr().err
    assert veil_audit(["summary", str(tmp_path / "absent.jsonl")]) == 2


def test_reader_merges_files_in_time_order(tmp_path):
    write_events(tmp_path / "late.jsonl", [BlocksZeroed(NODE_A, step=2, blocks=1, residue_blocks=0)],
                 clock=lambda: 200.0)
    write_events(tmp_path / "early.jsonl", [BlocksZeroed(NODE_A, step=1, blocks=1, residue_blocks=0)],
                 clock=lambda: 100.0)
    log = read_audit_files([tmp_path / "late.jsonl", tmp_path / "early.jsonl"])
    assert [record.ts for record in log.records] == [100, 200]


def test_capacity_arguments_are_validated():
    assert parse_capacities([f"{NODE_A}=4", f"{NODE_B}=16"]) == {NODE_A: 4, NODE_B: 16}
    for bad in [f"{NODE_A}", f"{NODE_A}=0", f"{NODE_A}=-3", "my-node=4", f"{NODE_A}=four"]:
        with pytest.raises(Exception) as caught:
            parse_capacities([bad])
        assert "my-node" not in str(caught.value)


def test_bare_audit_command_prints_usage(capsys):
    assert veil_audit([]) == 2
    assert "summary" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["report", "routes", "x.jsonl", "--out", "d", "--alpha", "1.5"],
    ["report", "routes", "x.jsonl", "--out", "d", "--windows", "0"],
    ["report", "residue", "x.jsonl", "--out", "d", "--block-size", "-4"],
    ["report", "residue", "x.jsonl"],  # --out is required
])
def test_report_options_are_checked(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        veil_audit(argv)
    assert exited.value.code == 2


def test_an_unwritable_report_directory_exits_2(tmp_path, capsys):
    write_events(tmp_path / "a.jsonl", [BlocksZeroed(NODE_A, step=1, blocks=1, residue_blocks=0)])
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert veil_audit(["report", "residue", str(tmp_path / "a.jsonl"), "--out", str(blocker)]) == 2
    assert "cannot write the report" in capsys.readouterr().err


def test_the_veil_command_line_includes_audit():
    from veil.cli import build_parser

    args = build_parser().parse_args(["audit", "report", "routes", "g.jsonl", "--out", "r", "--capacity", f"{NODE_A}=3"])
    assert args.handler.__module__ == "audit.cli" and args.capacity == [f"{NODE_A}=3"]
