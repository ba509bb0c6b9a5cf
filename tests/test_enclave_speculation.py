"""A node runs only the speculation its measured policy names: `veil node --speculative` against engine.speculation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from attestation.cli import register as register_attest
from attestation.measurement import measure, measure_model, measure_pair, measure_policy
from enclave.cli import node_settings, register
from enclave.errors import SelfCheckError
from enclave.node import engine_config
from enclave.selfcheck import check_node_settings
from enclave.settings import NodeSettings
from engine.tiny import write_tiny_model
from policy import load_policy, shipped_policy, shipped_policy_path
from policy.errors import ForbiddenOptimizationError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def policy_naming(speculation: str, folder: Path) -> Path:
    text = shipped_policy_path("dev").read_text()
    assert 'speculation = "none"' in text
    path = folder / f"speculation-{speculation}.toml"
    path.write_text(text.replace('speculation = "none"', f'speculation = "{speculation}"'))
    return path


def parse_node(*argv: str) -> NodeSettings:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return node_settings(parser.parse_args(["node", "--model", "m", *argv]))


def test_the_command_line_carries_the_speculation_to_the_engine():
    settings = parse_node("--speculative", "ngram", "--num-speculative-tokens", "5")
    assert (settings.speculative, settings.num_speculative_tokens) == ("ngram", 5)
    assert parse_node().speculative is None


def test_the_command_line_chooses_the_draw_or_leaves_it_to_the_engine(model_dir):
    limits = check_node_settings(NodeSettings(model=model_dir, policy="dev", attestation="sim"),
                                 shipped_policy("dev"), b"\0" * 32)
    default = engine_config(parse_node(), limits)
    assert default.sampling_draw is None and default.draw_kind == "inverse"
    raced = engine_config(parse_node("--sampling-draw", "race"), limits)
    assert (raced.sampling_draw, raced.draw_kind) == ("race", "race")
    with pytest.raises(SystemExit):  # argparse names the choices
        parse_node("--sampling-draw", "gumbel")


def test_a_node_refuses_speculation_its_policy_does_not_name(model_dir):
    settings = NodeSettings(model=model_dir, policy="dev", attestation="sim", speculative="ngram")
    with pytest.raises(SelfCheckError, match="engine.speculation = 'ngram'"):
        check_node_settings(settings, shipped_policy("dev"), b"\0" * 32)


def test_a_policy_naming_ngram_admits_it_and_the_engine_runs_it(model_dir, tmp_path):
    path = policy_naming("ngram", tmp_path)
    policy = load_policy(path)
    settings = NodeSettings(model=model_dir, policy=str(path), attestation="sim", speculative="ngram",
                            num_speculative_tokens=4)
    config = engine_config(settings, check_node_settings(settings, policy, b"\0" * 32))
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 4)
    # What the node may run is part of the digest it attests to.
    assert measure_policy(path) != measure_policy(shipped_policy_path("dev"))
    # The policy names one kind: it does not admit another.
    other = NodeSettings(model=model_dir, policy=str(path), attestation="sim", speculative="draft:/models/small")
    with pytest.raises(SelfCheckError, match="draft:DIR"):
        check_node_settings(other, policy, b"\0" * 32)


def test_a_draft_model_is_measured_with_the_model(model_dir, tmp_path, capsys):
    draft = write_tiny_model(tmp_path / "draft", seed=1)
    path = policy_naming("draft-model", tmp_path)
    settings = NodeSettings(model=model_dir, policy=str(path), attestation="sim", speculative=f"draft:{draft}")
    assert settings.draft_model == draft
    pair = measure(policy_path=path, model_dir=model_dir, draft_dir=settings.draft_model).model_digest
    assert pair == measure_pair(model_dir, draft) and pair not in (measure_model(model_dir), measure_model(draft))
    # An allowlist naming the target alone does not admit it with a draft: the draft is part of what runs.
    listed = path.read_text().replace("accept_unlisted_models = true", "accept_unlisted_models = false").replace(
        "allowed_model_digests = []", f'allowed_model_digests = ["{measure_model(model_dir).hex()}"]')
    only_target = tmp_path / "only-target.toml"
    only_target.write_text(listed)
    with pytest.raises(SelfCheckError, match="allowlist"):
        check_node_settings(settings, load_policy(only_target), pair)
    both = tmp_path / "both.toml"
    both.write_text(listed.replace(measure_model(model_dir).hex(), pair.hex()))
    config = engine_config(settings, check_node_settings(settings, load_policy(both), pair))
    assert config.speculative == f"draft:{draft}"
    # veil attest measure --draft-model prints the digest to list.
    parser = argparse.ArgumentParser()
    register_attest(parser.add_subparsers())
    args = parser.parse_args(["attest", "measure", "--model", str(model_dir), "--draft-model", str(draft),
                              "--policy", str(path), "--json"])
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out)["model_digest"] == pair.hex()
    # Another draft is another pair.
    (draft / "config.json").write_text((draft / "config.json").read_text() + " ")
    assert measure_pair(model_dir, draft) != pair


def test_the_policy_keeps_refusing_speculation_from_a_database(tmp_path):
    with pytest.raises(ForbiddenOptimizationError, match="database"):
        load_policy(policy_naming("database", tmp_path))
