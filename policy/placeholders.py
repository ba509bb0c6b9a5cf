"""Trust anchors a policy ships empty for its operator to fill: the transparency log's key and its witnesses'.

A policy that requires transparency with one of them empty admits no node, so it is refused when it is loaded,
naming each empty key, instead of letting `veil chat`, `veil proxy` or a gateway start and then find no node.
"""

from __future__ import annotations

from typing import Any

from policy.errors import PlaceholderError
from policy.model import TransparencyPolicy

# Where an operator learns what to put in each key; every refusal names it.
WHERE_DOCUMENTED = ('README.md, "Deploying on confidential-computing nodes" and "Transparency log: `veil log`, '
                    '`veil witness`"; SECURITY.md, "The transparency log (foundations)"')


def check_placeholders(name: str, table: dict[str, Any], transparency: TransparencyPolicy) -> None:
    """Refuse a policy that requires transparency, or names part of its log's trust, with a key left empty.

    `table` is the file's [transparency] table, already validated: only it keeps the witnesses in file order.
    """
    empty = _empty_keys(table)
    anything_named = len(empty) < 1 + len(table["witnesses"])
    if empty and (transparency.required or anything_named):
        raise PlaceholderError(_message(name, empty, transparency.required), paths=tuple(empty))


def _empty_keys(table: dict[str, Any]) -> dict[str, str]:
    """Each empty key's TOML path, with what it names (the witness's name) for the message."""
    empty = {"transparency.log_key": "the log"} if not table["log_key"] else {}
    for index, witness in enumerate(table["witnesses"]):
        if not witness["key"]:
            empty[f"transparency.witnesses[{index}].key"] = f"witness {witness['name']!r}"
    return empty


def _message(name: str, empty: dict[str, str], required: bool) -> str:
    why = ("it requires transparency: no node passes while one is empty" if required
           else "it names part of its log's trust, so it must name all of it")
    listed = ", ".join(f"{path} ({what})" for path, what in empty.items())
    return (f"policy {name!r} still has {len(empty)} placeholder key(s) its operator must fill ({why}): {listed}. "
            "Put in transparency.log_key the log's note verifier key, as `veil log init` prints it, and in each "
            "witness's key its cosignature/v1 key, as `veil witness --new-key` prints it (or remove a witness you "
            "do not use, keeping at least `quorum`); check the copy with `veil policy check FILE` and pass that "
            f"FILE as the policy ({WHERE_DOCUMENTED}). A local development fleet (`veil up`, `make demo`) uses "
            "the policy `dev` instead.")
