"""A node runs only the speculation its measured policy names: `veil node --speculative` against engine.speculation."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from attestation.measurement import measure_policy
from enclave.cli import node_settings, register
from enclave.errors import SelfCheckError
from enclave.node import engine_config
from enclave.selfcheck import check_node_settings
from enclave.settings import NodeSettings
from engine import EngineError
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


def test_draft_model_speculation_is_refused_by_the_engine_until_it_exists(model_dir, tmp_path):
    path = policy_naming("draft-model", tmp_path)
    settings = NodeSettings(model=model_dir, policy=str(path), attestation="sim", speculative="draft:/models/small")
    limits = check_node_settings(settings, load_policy(path), b"\0" * 32)
    with pytest.raises(EngineError, match="not implemented"):
        engine_config(settings, limits)


def test_the_policy_keeps_refusing_speculation_from_a_database(tmp_path):
    with pytest.raises(ForbiddenOptimizationError, match="database"):
        load_policy(policy_naming("database", tmp_path))
