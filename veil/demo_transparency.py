"""The demo's transparency lines: per node, what the SDK's offline check of its stapled proofs found.

Each node in the directory is checked as the SDK checks it (`client.verify.CandidateVerifier`: its
evidence, then its proofs against the policy's log and witness keys, no request to either); the
lines then show what was logged: the release, the key statement, the checkpoint and its cosigners.
"""

from __future__ import annotations

import time

import httpx

from attestation.transparency.client_check import CheckpointMemory, check_node, parse_bundle
from attestation.transparency.note import parse_note
from attestation.transparency.proof import parse_proof
from attestation.transparency.requirement import transparency_requirement
from client.directory import parse_directory
from client.transparency import identity
from client.verify import CandidateVerifier
from policy import Policy
from protocol.constants import DIRECTORY_PATH


def print_transparency(gateway_url: str, policy: Policy) -> None:
    requirement = transparency_requirement(policy.transparency)
    if requirement is None:
        print("transparency: the policy does not require it; no node was checked against a log")
        return
    directory = parse_directory(httpx.get(f"{gateway_url}{DIRECTORY_PATH}", timeout=30.0).json(), time.time())
    verifier, memory = CandidateVerifier(policy), CheckpointMemory()
    quorum = policy.transparency.quorum
    print(f"transparency (checked offline, as the SDK checks each candidate; quorum {quorum} of "
          f"{len(policy.transparency.witnesses)} witnesses, checkpoints at most {requirement.max_age_s} s old):")
    for entry in directory.entries:
        record = verifier.check(entry)
        if not record.ok or record.verified is None or entry.transparency is None:
            print(f"  node {entry.node_id[:16]}: REFUSED ({record.failed_check}: {record.failure})")
            continue
        bundle = parse_bundle(entry.transparency)
        logged = check_node(bundle, identity(record.verified), requirement, time.time(), memory)
        note = parse_note(parse_proof(bundle.node_key.proof).checkpoint)  # type: ignore[union-attr]
        cosigners = [name for name, key in requirement.policy.witnesses.items() if key.timestamp(note) is not None]
        key = logged.node_key
        print(f"  node {entry.node_id[:16]}: logged release {logged.release.version} "
              f"(code {logged.release.code_digest[:12]}…), logged key {key.key_config_digest[:12]}… valid until "
              f"{time.strftime('%H:%M:%S', time.localtime(key.not_after))}, checkpoint size "
              f"{logged.checkpoint_sizes[1]}, cosigned by {', '.join(cosigners)}")
