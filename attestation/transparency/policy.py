"""Which log and which witnesses a verifier trusts, in the shape of c2sp.org/tlog-policy.

One directive a line, `#` starts a comment:

    log <verifier key> [<url>]
    witness <name> <cosignature verifier key> [<url>]
    group <name> <threshold|all|any> <member> <member> ...
    quorum <name|none>

A group's members are witnesses or groups defined above it; `quorum` names the witness or group
whose cosignatures a checkpoint needs (`none`: the log's signature alone, for development).
"""

from __future__ import annotations

from dataclasses import dataclass

from attestation.transparency.cosignature import COSIGNATURE_TYPE, CosignatureVerifier
from attestation.transparency.encoded_keys import parse_verifier
from attestation.transparency.errors import NoteFormatError, PolicyFormatError
from attestation.transparency.note import ED25519_TYPE, NoteVerifier, check_name

MAX_POLICY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    threshold: int
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TransparencyPolicy:
    log: NoteVerifier
    log_url: str | None
    witnesses: dict[str, CosignatureVerifier]
    groups: dict[str, Group]
    quorum: str | None  # None: no cosignature needed

    def satisfied_by(self, cosigned: set[str]) -> bool:
        """Whether the witnesses named in `cosigned` (policy names) meet the quorum."""
        return self.quorum is None or self._met(self.quorum, cosigned)

    def _met(self, name: str, cosigned: set[str]) -> bool:
        if name in self.witnesses:
            return name in cosigned
        group = self.groups[name]
        return sum(self._met(member, cosigned) for member in group.members) >= group.threshold


def parse_policy(text: str) -> TransparencyPolicy:
    """Parse a policy; raise PolicyFormatError naming the line that is wrong (never its content)."""
    if len(text.encode()) > MAX_POLICY_BYTES:
        raise PolicyFormatError("a transparency policy is larger than 64 KiB")
    state = _Parsing()
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            state.directive(words)
        except (PolicyFormatError, NoteFormatError) as error:
            raise PolicyFormatError(f"transparency policy line {number}: {error}") from None
    return state.result()


class _Parsing:
    def __init__(self) -> None:
        self.log: tuple[NoteVerifier, str | None] | None = None
        self.witnesses: dict[str, CosignatureVerifier] = {}
        self.groups: dict[str, Group] = {}
        self.quorum: str | None | bool = False  # False: not given yet

    def directive(self, words: list[str]) -> None:
        keyword, args = words[0], words[1:]
        if keyword == "log" and 1 <= len(args) <= 2:
            self._log(args)
        elif keyword == "witness" and 2 <= len(args) <= 3:
            self._witness(args)
        elif keyword == "group" and len(args) >= 3:
            self._group(args)
        elif keyword == "quorum" and len(args) == 1:
            self._quorum(args[0])
        else:
            raise PolicyFormatError("expected log, witness, group or quorum with its arguments")

    def _log(self, args: list[str]) -> None:
        if self.log is not None:
            raise PolicyFormatError("a policy names one log")
        key = parse_verifier(args[0])
        if key.key_type != ED25519_TYPE:
            raise PolicyFormatError("a log key must be an Ed25519 note key (type 0x01)")
        self.log = (key, args[1] if len(args) == 2 else None)

    def _witness(self, args: list[str]) -> None:
        self._new_name(args[0])
        key = parse_verifier(args[1])
        if not isinstance(key, CosignatureVerifier) or key.key_type != COSIGNATURE_TYPE:
            raise PolicyFormatError("a witness key must be a cosignature/v1 key (type 0x04)")
        if any(known.public == key.public for known in self.witnesses.values()):
            # c2sp.org/tlog-cosignature: the signed message does not commit to the cosigner's name, so one
            # witness's signature line, copied under the other name, would count twice toward a quorum.
            raise PolicyFormatError("one witness key under two names: each witness needs a key of its own")
        self.witnesses[args[0]] = key

    def _group(self, args: list[str]) -> None:
        name, threshold, members = args[0], args[1], tuple(args[2:])
        self._new_name(name)
        if unknown := [member for member in members if member not in self.witnesses and member not in self.groups]:
            raise PolicyFormatError(f"group {name} names {len(unknown)} member(s) not defined above it")
        if len(set(members)) != len(members):
            raise PolicyFormatError(f"group {name} names a member twice")
        count = {"all": len(members), "any": 1}.get(threshold)
        if count is None:
            if not (threshold.isascii() and threshold.isdigit()):
                raise PolicyFormatError("a group's threshold must be a number, all or any")
            count = int(threshold)
        if not 1 <= count <= len(members):
            raise PolicyFormatError(f"group {name}'s threshold must be between 1 and its number of members")
        self.groups[name] = Group(name, count, members)

    def _quorum(self, name: str) -> None:
        if self.quorum is not False:
            raise PolicyFormatError("a policy has one quorum")
        if name != "none" and name not in self.witnesses and name not in self.groups:
            raise PolicyFormatError("the quorum must name a witness or group defined above it, or none")
        self.quorum = None if name == "none" else name

    def _new_name(self, name: str) -> None:
        check_name(name)
        if name in self.witnesses or name in self.groups or name == "none":
            raise PolicyFormatError("a witness or group name is defined twice (or is 'none')")

    def result(self) -> TransparencyPolicy:
        if self.log is None:
            raise PolicyFormatError("a transparency policy must name its log")
        if self.quorum is False:
            raise PolicyFormatError("a transparency policy must state its quorum (or quorum none)")
        return TransparencyPolicy(self.log[0], self.log[1], dict(self.witnesses), dict(self.groups),
                                  self.quorum or None)
