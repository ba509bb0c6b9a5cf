"""A Veil policy's `[transparency]` section as the client's check needs it.

The section names the log key, the witnesses and how many of them must cosign; here it is written
in the c2sp.org/tlog-policy shape (`log`, one `witness` line each, a group of `quorum` of them) and
read by that parser, so a policy file and a tlog-policy file mean the same thing in one code path.
"""

from __future__ import annotations

from attestation.transparency.client_check import TransparencyRequirement
from attestation.transparency.errors import NotLoggedError
from attestation.transparency.policy import parse_policy
from policy.model import TransparencyPolicy

QUORUM_GROUP = "policy-quorum"


def tlog_policy_text(section: TransparencyPolicy) -> str:
    """The section in the tlog-policy shape (it names a log)."""
    lines = [f"log {section.log_key}"]
    lines += [f"witness {witness.name} {witness.key}" for witness in section.witnesses]
    if section.quorum:
        lines.append(f"group {QUORUM_GROUP} {section.quorum} {' '.join(w.name for w in section.witnesses)}")
        lines.append(f"quorum {QUORUM_GROUP}")
    else:
        lines.append("quorum none")
    return "\n".join(lines) + "\n"


def transparency_requirement(section: TransparencyPolicy) -> TransparencyRequirement | None:
    """What a node must staple under `section`; None where the policy does not require transparency.

    Raises PolicyFormatError for a key that is not a note key of the right type, and NotLoggedError
    where the policy requires transparency but names no log yet: no node can pass then.
    """
    if not section.required:
        return None
    if not section.log_key:
        raise NotLoggedError("the policy requires transparency but names no log key yet; "
                             "no node passes until the release process names the log")
    return TransparencyRequirement(parse_policy(tlog_policy_text(section)), section.max_checkpoint_age_s)
