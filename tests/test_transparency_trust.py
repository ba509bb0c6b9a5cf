"""Whom a policy requiring transparency trusts: never the log alone, and each witness key once.

`strict` ships with placeholders for its log's key and its witnesses' keys, and a quorum; it refuses to load
until every one is filled (no node could pass before), naming each empty key and echoing none. No policy that
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
from policy import load_policy, parse_policy
from policy.errors import InvalidValueError, PlaceholderError
from policy.shipped import shipped_policy_path
from tests.policy_support import FILLED_WITNESSES, filled_strict, filled_strict_text
from veil.fleet_transparency import make_log_keys, write_transparency_policy

LOG_KEY = generate_signer("log.example/veil").verifier.encode()
FIRST = generate_cosigner("witness-a")
SAME_KEY_OTHER_NAME = CosignatureSigner("witness-b", FIRST.seed)  # one witness's key, listed twice


def _with_section(text: str, section: str) -> str:
    """`text` with its [transparency] section (the last one of the shipped policies) replaced by `section`."""
    return text[:text.index("[transparency]")] + "[transparency]\n" + section + "max_checkpoint_age_s = 86400\n"


def _strict() -> str:
    return shipped_policy_path("strict").read_text(encoding="utf-8")


def test_strict_ships_placeholders_that_refuse_to_load_until_each_is_filled() -> None:
    filled = filled_strict().transparency  # only its keys differ from the shipped file
    assert filled.required and filled.quorum >= 1 and len(filled.witnesses) == 3 > filled.quorum
    witness_keys = tuple(f"transparency.witnesses[{index}].key" for index in range(3))
    with pytest.raises(PlaceholderError) as refused:
        parse_policy(_strict())
    assert refused.value.paths == ("transparency.log_key", *witness_keys)
    with pytest.raises(PlaceholderError, match=r"witnesses\[0\]\.key \(witness 'witness-1'\)") as refused:
        parse_policy(_strict().replace('log_key = ""', f'log_key = "{LOG_KEY}"'))  # the log named, no witness yet
    assert refused.value.paths == witness_keys and LOG_KEY not in str(refused.value)
    second = FILLED_WITNESSES[1].verifier.encode()
    with pytest.raises(PlaceholderError) as refused:  # one witness left empty
        parse_policy(filled_strict_text().replace(f'key = "{second}"', 'key = ""'))
    assert refused.value.paths == ("transparency.witnesses[1].key",)
    message = str(refused.value)
    assert not [key for key in (filled.log_key, *(w.key for w in filled.witnesses)) if key in message]  # no key echoed


def test_any_policy_requiring_transparency_is_refused_while_its_log_key_is_empty() -> None:
    witnessed = f'{{ name = "witness-a", key = "{FIRST.verifier.encode()}" }}'
    for required in ("true", "false"):  # a policy naming a witness must name the log too, even under dev
        section = f'required = {required}\nlog_key = ""\nwitnesses = [{witnessed}]\nquorum = 1\n'
        with pytest.raises(PlaceholderError, match=r"transparency\.log_key \(the log\)") as refused:
            parse_policy(_with_section(shipped_policy_path("dev").read_text(encoding="utf-8"), section))
        assert refused.value.paths == ("transparency.log_key",) and FIRST.verifier.encode() not in str(refused.value)


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
