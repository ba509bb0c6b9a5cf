"""The residue report fed by a real fleet: canary requests in, zero residue and no canary out.

One local fleet on loopback (a gateway and three nodes, real processes) serves a handful of
requests whose prompts carry canaries: whole and streamed, chat and text completions, n = 1 and
n = 2. Then the fleet stops, and the audit files its nodes wrote are turned into the residue
report with the `audit` package's own API and command: every zeroing batch in the files is
accounted for, no freed block kept data, the blocks zeroed cover at least the prompts' blocks,
and no canary appears in anything the fleet or the reports wrote. The gateway's audit file gives
the routes report, which must render.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from attestation.sim_root import ROOT_DIR_ENV
from audit.events import BlocksZeroed, NodeStarted, RequestFinished, RequestStatus, RouteDecision, RouteOutcome
from audit.records import AuditLog, read_audit_files
from audit.reports.document import WrittenReport
from audit.reports.residue import DEFAULT_BLOCK_SIZE, ResidueReport, build_residue_report, write_residue_report
from audit.reports.routes import RoutesReport, build_routes_report, write_routes_report
from client.sdk import Client
from engine.tiny import write_tiny_model
from engine.tokenizer import ChatMessage, Tokenizer
from tests.test_audit_cli import veil_audit
from tests.test_audit_routes import assert_png
from veil.fleet import Fleet, FleetSettings

pytestmark = pytest.mark.slow
MODEL = "tiny-model"
NODES = 3
CANARIES = [f"CANARY{secrets.token_hex(8).upper()}" for _ in range(6)]


@dataclass
class Served:
    """The stopped fleet, what it served, and the reports built from its audit files."""

    fleet: Fleet
    requests: int
    prompt_blocks: int  # KV blocks the prompts alone fill, counted with the model's own tokenizer
    node_log: AuditLog
    gateway_log: AuditLog
    residue: ResidueReport
    residue_written: WrittenReport
    routes: RoutesReport
    routes_written: WrittenReport


def _send_canaries(client: Client, tokenizer: Tokenizer) -> tuple[int, int]:
    """Six requests, each carrying a canary twice: whole and streamed, chat and text, n = 1 and 2.

    Returns the number of requests and the KV blocks their prompts fill."""
    sent = prompt_blocks = 0
    for index, canary in enumerate(CANARIES):
        content = f"Please repeat exactly: {canary} {canary}"
        n = 2 if index >= 4 else None
        if index % 2:
            messages = [{"role": "user", "content": content}]
            with client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=12,
                                                temperature=0.8, seed=index, n=n) as stream:
                chunks = list(stream)
            assert {choice.index for chunk in chunks for choice in chunk.choices} == set(range(n or 1))
            prompt = tokenizer.encode_chat([ChatMessage("user", content)])
        else:
            answer = client.completions.create(model=MODEL, prompt=content, max_tokens=12, temperature=0.8,
                                               seed=index, n=n)
            assert len(answer.choices) == (n or 1)
            prompt = tokenizer.encode(content)
        sent += 1
        prompt_blocks += math.ceil(len(prompt) / DEFAULT_BLOCK_SIZE)
    return sent, prompt_blocks


def _serve(fleet: Fleet, model_dir: Path) -> tuple[int, int]:
    previous = os.environ.get(ROOT_DIR_ENV)
    try:
        fleet.start()
        os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)  # the client's dev policy trusts the fleet's root
        with Client(fleet.gateway_url, policy="dev") as client:
            return _send_canaries(client, Tokenizer(model_dir))
    finally:
        fleet.stop()  # SIGTERM: every process closes its audit sink, writing out what it holds
        if previous is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    root = tmp_path_factory.mktemp("e2e-residue")
    model_dir = write_tiny_model(root / MODEL)
    fleet = Fleet(FleetSettings(nodes=NODES, model_dir=model_dir, workdir=root / "fleet", torch_threads=1,
                                capacity=4))
    requests, prompt_blocks = _serve(fleet, model_dir)
    node_log = read_audit_files(_node_files(fleet))
    gateway_log = read_audit_files([fleet.paths.audit / "gateway.jsonl"])
    residue = build_residue_report(node_log.records, truncated_tails=node_log.truncated_tails)
    routes = build_routes_report(gateway_log.records)
    reports = fleet.workdir / "reports"  # inside the work folder, so the canary scan reads them too
    return Served(fleet, requests, prompt_blocks, node_log, gateway_log,
                  residue, write_residue_report(residue, reports / "residue"),
                  routes, write_routes_report(routes, reports / "routes"))


def _node_files(fleet: Fleet) -> list[Path]:
    return [path for path in fleet.audit_files() if path.name.startswith("node-")]


def _events(log: AuditLog, kind: type) -> list:
    return [record.event for record in log.records if isinstance(record.event, kind)]


def test_every_node_reports_and_every_request_is_accounted_for(served: Served) -> None:
    assert served.node_log.files == NODES and served.node_log.truncated_tails == 0
    started = {event.node_id for event in _events(served.node_log, NodeStarted)}
    assert len(started) == NODES and set(served.residue.nodes) == started
    finished = _events(served.node_log, RequestFinished)
    assert len(finished) == served.requests and all(event.status is RequestStatus.OK for event in finished)
    assert sum(account.ok_requests for account in served.residue.nodes.values()) == served.requests


def test_the_residue_report_accounts_for_every_zeroing_batch_and_shows_zero_residue(served: Served) -> None:
    batches = _events(served.node_log, BlocksZeroed)
    report = served.residue
    assert batches, "no zeroing batch was audited; the report would prove nothing"
    assert report.total_batches == len(batches)
    assert report.total_blocks == sum(batch.blocks for batch in batches)
    # Independent of the report's bucketed bound: every prompt block the fleet filled was zeroed.
    assert report.total_blocks >= served.prompt_blocks >= served.requests
    assert report.total_residue == 0 and not report.residue_batches
    assert report.dropped_events == 0 and report.truncated_tails == 0
    for account in report.nodes.values():
        assert account.shortfall == 0 and account.out_of_order_batches == 0
    assert report.passed

    written = served.residue_written
    assert written.passed
    markdown = written.markdown.read_text()
    assert f"✓ Zero residue: {len(batches)} zeroing batches, {report.total_blocks} freed blocks zeroed" in markdown
    assert "RED LINE" not in markdown and 'class="red"' not in written.html.read_text()
    for image in written.images:
        assert_png(image)


def test_the_residue_command_on_the_node_files_passes(served: Served) -> None:
    out_dir = served.fleet.workdir / "reports" / "residue-cli"
    assert veil_audit(["report", "residue", *map(str, _node_files(served.fleet)), "--out", str(out_dir)]) == 0
    assert "✓ Zero residue" in (out_dir / "residue.md").read_text()
    assert_png(out_dir / "residue_blocks.png")


def test_the_routes_report_renders_from_the_gateways_audit_file(served: Served) -> None:
    routes = _events(served.gateway_log, RouteDecision)
    assert len(routes) == served.requests
    assert all(route.outcome in (RouteOutcome.OK, RouteOutcome.FAILOVER) for route in routes)
    observations = served.routes.observations
    assert observations.chosen.size == served.requests
    assert set(observations.node_ids) == {event.node_id for event in _events(served.node_log, NodeStarted)}
    written = served.routes_written
    assert len(written.images) == 3
    for image in written.images:
        assert_png(image)
    assert written.html.read_text().count("data:image/png;base64,") == 3


def test_no_canary_in_anything_the_fleet_or_the_reports_wrote(served: Served) -> None:
    written = [path for path in served.fleet.workdir.rglob("*") if path.is_file()]
    suffixes = {path.suffix for path in written}
    assert {".jsonl", ".err", ".out", ".md", ".html", ".png"} <= suffixes, "the scan would miss a kind of file"
    for path in written:
        data = path.read_bytes()
        for canary in CANARIES:
            assert canary.encode() not in data, f"a canary leaked into {path.relative_to(served.fleet.workdir)}"
