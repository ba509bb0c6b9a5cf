"""A local fleet's issuer set-up: its account's credentials, the issuer's configuration and the policy listing its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from issuer.accounts import authenticate
from issuer.config import load_config
from policy import load_policy, shipped_policy
from veil.fleet import FleetError
from veil.fleet_access import (
    ISSUER_NAME,
    FleetAccount,
    printed_key_id,
    write_issuer_config,
    write_policy_listing,
)

KEY_ID = "ab" * 32


def test_the_issuer_accepts_the_fleet_accounts_credential(tmp_path: Path) -> None:
    account = FleetAccount.generate("fleet-account")
    config = load_config(write_issuer_config(tmp_path / "issuer.toml", account, tokens_per_period=7))
    assert config.issuer_name == ISSUER_NAME and config.tokens_per_period == 7
    assert authenticate(f"Bearer {account.credential()}", config.accounts, ISSUER_NAME).name == "fleet-account"


def test_a_credential_of_another_key_is_refused(tmp_path: Path) -> None:
    from issuer.errors import AccountAuthError

    registered, impostor = FleetAccount.generate("fleet-account"), FleetAccount.generate("fleet-account")
    config = load_config(write_issuer_config(tmp_path / "issuer.toml", registered, tokens_per_period=7))
    with pytest.raises(AccountAuthError):
        authenticate(f"Bearer {impostor.credential()}", config.accounts, ISSUER_NAME)


def test_the_fleets_policy_is_dev_with_the_issuer_and_its_key_listed(tmp_path: Path) -> None:
    written = load_policy(write_policy_listing(tmp_path / "policy.toml", "dev", (KEY_ID,)))
    dev = shipped_policy("dev")
    assert written.authorization.issuer_name == ISSUER_NAME and written.authorization.issuer_keys == (KEY_ID,)
    assert written.name == dev.name and written.attestation == dev.attestation
    assert written.digest != dev.digest  # the nodes measure the file that lists the key


def test_a_base_policy_that_already_names_an_issuer_is_refused(tmp_path: Path) -> None:
    listing = write_policy_listing(tmp_path / "listing.toml", "dev", (KEY_ID,))
    with pytest.raises(FleetError, match=r"\[authorization\] section is empty"):
        write_policy_listing(tmp_path / "again.toml", str(listing), ("cd" * 32,))


def test_the_key_id_veil_issuer_prints_is_the_one_it_publishes(tmp_path: Path) -> None:
    from issuer.keys import load_keyring

    added = subprocess.run([sys.executable, "-m", "veil", "issuer", "--keys", str(tmp_path), "--add-key-not-before",
                            "0"], capture_output=True, text=True, timeout=120, check=True)
    (published,) = load_keyring(tmp_path).signing_keys(now=4e9)
    assert printed_key_id(added.stdout) == published.token_key.key_id.hex()


def test_output_without_a_key_id_is_an_error() -> None:
    with pytest.raises(FleetError, match="did not print the id"):
        printed_key_id("veil issuer: cannot start: the key directory is not writable")
