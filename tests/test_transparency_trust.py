"""Whom a policy requiring transparency trusts: never the log alone, and each witness key once.

`strict` ships with placeholders for its witnesses and a quorum; it loads while it names no log (no node
passes then) and refuses to load once its log is named with a witness key still empty. No policy that
requires transparency loads with `quorum = 0`: the log's own signature proves neither that other clients
see the same history nor how old a checkpoint is. And one witness key under two names is refused
(c2sp.org/tlog-cosignature: a cosignature/v1 signature does not cover the cosigner's name, so a copy of
one witness's signature line under the other name would count twice toward the quorum).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation.transparency.cosignature import CosignatureSigner, generate_cosigner
from attestation.transparency.errors import PolicyFormatError
from attestation.transparency.note import generate_signer
from attestation.transparency.policy import parse_policy as parse_tlog_policy
from client.sdk import Client
from policy import load_policy, parse_policy, shipped_policy
from policy.errors import InvalidValueError
from policy.shipped import shipped_policy_path
from veil.fleet_transparency import make_log_keys, write_transparency_policy

LOG_KEY = generate_signer("log.example/veil").verifier.encode()
FIRST = generate_cosigner("witness-a")
SAME_KEY_OTHER_NAME = CosignatureSigner("witness-b", FIRST.seed)  # one witness's key, listed twice


def _with_section(text: str, section: str) -> str:
    """`text` with its [transparency] section (the last one of the shipped policies) replaced by `section`."""
    return text[:text.index("[transparency]")] + "[transparency]\n" + section + "max_checkpoint_age_s = 86400\n"


def _strict() -> str:
    return shipped_policy_path("strict").read_text(encoding="utf-8")


def test_strict_ships_placeholders_that_refuse_to_load_once_its_log_is_named() -> None:
    shipped = shipped_policy("strict").transparency
    assert shipped.required and shipped.log_key == "" and shipped.quorum >= 1
    assert len(shipped.witnesses) >= shipped.quorum and all(witness.key == "" for witness in shipped.witnesses)
    with pytest.raises(InvalidValueError, match="witness-1, witness-2, witness-3 have no key yet"):
        parse_policy(_strict().replace('log_key = ""', f'log_key = "{LOG_KEY}"'))


def test_strict_filled_by_the_release_process_loads(tmp_path: Path) -> None:
    """As `veil up --transparency` and the tests fill it: the log, its witnesses and a quorum of them."""
    keys = make_log_keys(tmp_path / "keys")
    filled = load_policy(write_transparency_policy(tmp_path / "strict.toml", "strict", keys, max_age_s=900))
    assert not filled.is_development and filled.transparency.quorum == 2
    assert [witness.key for witness in filled.transparency.witnesses] == list(keys.witness_verifiers)


@pytest.mark.parametrize("base", ["strict", "dev"])
def test_no_policy_requiring_transparency_trusts_the_log_alone(base: str, tmp_path: Path) -> None:
    text = shipped_policy_path(base).read_text(encoding="utf-8")  # type: ignore[arg-type]
    log_alone = _with_section(text, f'required = true\nlog_key = "{LOG_KEY}"\nwitnesses = []\nquorum = 0\n')
    with pytest.raises(InvalidValueError, match="quorum = 0 .* trusts the log's signature alone"):
        parse_policy(log_alone)
    (tmp_path / "policy.toml").write_text(log_alone, encoding="utf-8")
    with pytest.raises(InvalidValueError, match="quorum = 0"):  # the SDK, `veil chat` and `veil proxy` load it so
        Client("http://127.0.0.1:9", policy=str(tmp_path / "policy.toml"))
    witnessed = f'{{ name = "witness-a", key = "{FIRST.verifier.encode()}" }}'
    with pytest.raises(InvalidValueError, match="quorum = 0"):  # witnesses listed, none of them needed
        parse_policy(_with_section(text, f'required = true\nlog_key = "{LOG_KEY}"\nwitnesses = [{witnessed}]\n'
                                         "quorum = 0\n"))


def test_one_witness_key_under_two_names_is_refused() -> None:
    witnesses = ", ".join(f'{{ name = "{signer.name}", key = "{signer.verifier.encode()}" }}'
                          for signer in (FIRST, SAME_KEY_OTHER_NAME))
    assert FIRST.verifier.encode() != SAME_KEY_OTHER_NAME.verifier.encode()  # two strings, one key
    with pytest.raises(InvalidValueError, match="one witness key under two names"):
        parse_policy(_with_section(_strict(), f'required = true\nlog_key = "{LOG_KEY}"\nwitnesses = [{witnesses}]\n'
                                              "quorum = 2\n"))
    tlog_policy = (f"log {LOG_KEY}\nwitness witness-a {FIRST.verifier.encode()}\n"
                   f"witness witness-b {SAME_KEY_OTHER_NAME.verifier.encode()}\ngroup both all witness-a witness-b\n"
                   "quorum both\n")
    with pytest.raises(PolicyFormatError, match="line 3: .*one witness key under two names"):
        parse_tlog_policy(tlog_policy)
