"""A local fleet's transparency log and witnesses (`FleetSettings(transparency=True)`, the demo).

The fleet makes a log key and two witness keys, writes its policy requiring a quorum of both
witnesses, logs the release statement of what its nodes run (code, policy and model digests, as
`veil attest measure` computes them), has the checkpoint cosigned, and runs `veil log serve --key`
so that each node logs its own key statement (with its evidence) and staples its proofs.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx

from attestation.measurement import measure
from attestation.transparency.cosignature import generate_cosigner
from attestation.transparency.note import NoteSigner, generate_signer
from attestation.transparency.statements import ReleaseStatement, encode_statement
from transparency.cosign import cosign_checkpoint
from transparency.keys import write_key
from transparency.log import append_entries, init_log
from policy import load_policy
from policy.shipped import resolve_policy_path
from veil import __version__
from veil.fleet_access import FleetError

LOG_ORIGIN = "veil.localhost/fleet-log"
WITNESSES = ("witness-a", "witness-b")
QUORUM = len(WITNESSES)
_SECTION = re.compile(r"^\[transparency\]\n(?:(?!\[).*\n?)*", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class FleetLogKeys:
    """Where the fleet's log and witness keys are, and the public keys its policy names."""

    folder: Path
    log_key: Path
    log_verifier: str
    witness_keys: tuple[Path, ...]
    witness_verifiers: tuple[str, ...]

    @property
    def log_directory(self) -> Path:
        return self.folder / "log"

    def witness_state(self, index: int) -> Path:
        return self.folder / f"{WITNESSES[index]}-state.json"


def make_log_keys(folder: Path) -> FleetLogKeys:
    """A fresh log (empty, in `folder`/log) and witness keys; an earlier fleet's are replaced."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    signer = generate_signer(LOG_ORIGIN)
    write_key(folder / "log.key", signer.encode())
    init_log(folder / "log", signer)
    paths, verifiers = [], []
    for name in WITNESSES:
        cosigner = generate_cosigner(name)
        write_key(folder / f"{name}.key", cosigner.encode())
        paths.append(folder / f"{name}.key")
        verifiers.append(cosigner.verifier.encode())
    return FleetLogKeys(folder, folder / "log.key", signer.verifier.encode(), tuple(paths), tuple(verifiers))


def write_transparency_policy(path: Path, base_policy: str, keys: FleetLogKeys, max_age_s: int) -> Path:
    """`base_policy` with a [transparency] section requiring the fleet's log and a quorum of both witnesses."""
    text = resolve_policy_path(base_policy).read_text(encoding="utf-8")
    witnesses = ", ".join(f'{{ name = "{name}", key = "{key}" }}' for name, key in zip(WITNESSES, keys.witness_verifiers))
    section = (f'[transparency]\nrequired = true\nlog_key = "{keys.log_verifier}"\nwitnesses = [{witnesses}]\n'
               f"quorum = {QUORUM}\nmax_checkpoint_age_s = {max_age_s}\n")
    if len(_SECTION.findall(text)) != 1:
        raise FleetError(f"a fleet with a transparency log needs a base policy with one [transparency] section; "
                         f"{base_policy} has none")
    path.write_text(_SECTION.sub(section, text), encoding="utf-8")
    if load_policy(path).transparency.log_key != keys.log_verifier:
        raise FleetError(f"the policy written to {path} does not name the fleet's log")
    return path


def release_of(policy_path: str, model_dir: Path) -> ReleaseStatement:
    """The release statement of the code installed now, the policy and the model, as `veil attest measure` sees them."""
    measured = measure(policy_path=policy_path, model_dir=model_dir)
    return ReleaseStatement(__version__, measured.code_digest.hex(), measured.policy_digest.hex(),
                            (measured.model_digest.hex(),))


def log_release(keys: FleetLogKeys, signer: NoteSigner, release: ReleaseStatement, witness_urls: list[str]) -> None:
    """Append `release` and have both witnesses cosign the new checkpoint."""
    append_entries(keys.log_directory, signer, [encode_statement(release)])
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        if len(cosign_checkpoint(keys.log_directory, signer, witness_urls, client)) != QUORUM:
            raise FleetError("the fleet's witnesses did not both cosign the release")
