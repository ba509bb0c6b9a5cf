"""Typed readers for policy values: each returns the normalized value or raises InvalidValueError."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from policy.errors import InvalidValueError
from policy.model import SNP_PRODUCTS, TDX_TCB_STATUSES, LaunchReference, SnpTcbMinimum, WitnessKey

Reader = Callable[[str, Any], Any]

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_HEX_MEASUREMENT = re.compile(r"[0-9a-f]{96}")
_ADVISORY = re.compile(r"INTEL-SA-\d{5}")
_LAUNCH_KEYS = {"sev-snp": {"tee", "code", "measurement"}, "tdx": {"tee", "code", "mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3"}}
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
# A C2SP note verifier key: name+<8 hex key hash>+<base64 of type byte and key>; fully parsed (hash and type
# checked) by attestation.transparency.requirement, which the policy package does not import.
_NOTE_KEY = re.compile(r"[!-*,-~]{1,128}\+[0-9a-f]{8}\+[A-Za-z0-9+/]{43,}={0,2}")
_HOST_NAME = re.compile(r"(?:[a-z0-9-]{1,63}(?:\.[a-z0-9-]{1,63})*)?", re.ASCII)


def boolean(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValueError(f"{where} must be true or false")
    return value


def only_true(reason: str) -> Reader:
    """A boolean whose one supported value is true; `reason` says why false is refused."""

    def read(where: str, value: Any) -> bool:
        if value is not True:
            raise InvalidValueError(f"{where} must be true: {reason}")
        return True

    return read


def integer(low: int, high: int) -> Reader:
    def read(where: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidValueError(f"{where} must be an integer from {low} to {high}")
        return value

    return read


def choice(*allowed: str) -> Reader:
    def read(where: str, value: Any) -> str:
        if value not in allowed:
            raise InvalidValueError(f"{where} must be one of {list(allowed)}")
        return value

    return read


def name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidValueError(f"{where} must be 1-64 lowercase letters, digits or '-'")
    return value


def host_name(where: str, value: Any) -> str:
    """A DNS host name (lower-case letters, digits, '.', '-'), or "" for none."""
    if not isinstance(value, str) or len(value) > 253 or not _HOST_NAME.fullmatch(value):
        raise InvalidValueError(f"{where} must be a lower-case host name (letters, digits, '.', '-') or empty")
    return value


def digest_set(where: str, value: Any) -> tuple[str, ...]:
    """A list of SHA-256 hex digests, lower-cased, de-duplicated and sorted."""
    items = _string_list(where, value)
    normalized = sorted({item.lower() for item in items})
    for item in normalized:
        if not _HEX_DIGEST.fullmatch(item):
            raise InvalidValueError(f"{where} entries must be SHA-256 digests: 64 hexadecimal digits")
    if len(normalized) != len(items):
        raise InvalidValueError(f"{where} lists a digest twice; list each once")
    return tuple(normalized)


def hex_set(size: int, what: str) -> Reader:
    """A list of `size`-byte values in hex (`what` names them), lower-cased, each once, sorted."""
    pattern = re.compile(f"[0-9a-f]{{{2 * size}}}")

    def read(where: str, value: Any) -> tuple[str, ...]:
        items = _string_list(where, value)
        normalized = sorted({item.lower() for item in items})
        if not all(pattern.fullmatch(item) for item in normalized):
            raise InvalidValueError(f"{where} entries must be {what}: {2 * size} hexadecimal digits")
        if len(normalized) != len(items):
            raise InvalidValueError(f"{where} lists a value twice; list each once")
        return tuple(normalized)

    return read


def optional_hex(size: int, what: str) -> Reader:
    """One `size`-byte value in hex (`what` names it), lower-cased, or "" for none."""
    pattern = re.compile(f"(?:[0-9a-f]{{{2 * size}}})?")

    def read(where: str, value: Any) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value.lower()):
            raise InvalidValueError(f"{where} must be a {what}: {2 * size} hexadecimal digits, or \"\" for none")
        return value.lower()

    return read


def tdx_statuses(where: str, value: Any) -> tuple[str, ...]:
    """Intel TCB statuses a policy accepts: UpToDate among them; Revoked never."""
    statuses = subset_of(*TDX_TCB_STATUSES)(where, value)
    if "UpToDate" not in statuses:
        raise InvalidValueError(f"{where} must include \"UpToDate\"")
    return statuses


def advisory_ids(where: str, value: Any) -> tuple[str, ...]:
    """Intel security advisory ids (INTEL-SA-NNNNN), each once, sorted."""
    items = _string_list(where, value)
    if not all(_ADVISORY.fullmatch(item) for item in items) or len(set(items)) != len(items):
        raise InvalidValueError(f"{where} must list distinct Intel advisory ids such as \"INTEL-SA-00837\"")
    return tuple(sorted(items))


_SNP_TCB_KEYS = ("boot_loader", "tee", "snp", "microcode")


def snp_tcb_minimums(where: str, value: Any) -> tuple[SnpTcbMinimum, ...]:
    """Inline tables {product, boot_loader, tee, snp, microcode} (Turin also fmc), one per product, sorted."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidValueError(f"{where} must be a list of tables such as "
                                "{ product = \"Milan\", boot_loader = 0, tee = 0, snp = 0, microcode = 0 }")
    minimums = [_snp_tcb_minimum(f"{where}[{index}]", item) for index, item in enumerate(value)]
    if len({minimum.product for minimum in minimums}) != len(minimums):
        raise InvalidValueError(f"{where} names a product twice; give each product one minimum")
    return tuple(sorted(minimums, key=lambda minimum: minimum.product))


def _snp_tcb_minimum(where: str, table: dict[str, Any]) -> SnpTcbMinimum:
    product = table.get("product")
    if product not in SNP_PRODUCTS:
        raise InvalidValueError(f"{where}.product must be one of {list(SNP_PRODUCTS)}")
    # Turin's TCB_VERSION adds the FMC's patch level; the older families have none.
    keys = {"product", *_SNP_TCB_KEYS, *(("fmc",) if product == "Turin" else ())}
    if set(table) != keys:
        raise InvalidValueError(f"{where} for {product} takes exactly {sorted(keys)}")
    read = integer(0, 255)
    levels = {key: read(f"{where}.{key}", table[key]) for key in sorted(keys - {"product"})}
    return SnpTcbMinimum(product=product, **levels)


def launch_references(where: str, value: Any) -> tuple[LaunchReference, ...]:
    """Inline tables {tee, code, measurement} (SEV-SNP) or {tee, code, mrtd, rtmr0-3 optional} (TDX), sorted."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidValueError(f"{where} must be a list of tables such as {{ tee = \"sev-snp\", code = ..., measurement = ... }}")
    references = sorted({_launch_reference(f"{where}[{index}]", item) for index, item in enumerate(value)},
                        key=lambda ref: (ref.tee, ref.code_digest, ref.measurement, [rtmr or "" for rtmr in ref.rtmrs]))
    if len(references) != len(value):
        raise InvalidValueError(f"{where} lists a launch measurement twice; list each once")
    return tuple(references)


def _launch_reference(where: str, table: dict[str, Any]) -> LaunchReference:
    tee = table.get("tee")
    if tee not in _LAUNCH_KEYS:
        raise InvalidValueError(f"{where}.tee must be one of {sorted(_LAUNCH_KEYS)}")
    unknown = set(table) - _LAUNCH_KEYS[tee]
    required = {"tee", "code", "measurement" if tee == "sev-snp" else "mrtd"}
    if unknown or not required <= set(table):
        raise InvalidValueError(f"{where} for {tee} takes exactly {sorted(required)} (TDX also rtmr0-rtmr3)")
    code = table["code"]
    if not isinstance(code, str) or not _HEX_DIGEST.fullmatch(code.lower()):
        raise InvalidValueError(f"{where}.code must be a SHA-256 digest: 64 hexadecimal digits")
    measurement = _measurement(f"{where}.measurement", table.get("measurement", table.get("mrtd")))
    rtmrs = tuple(_measurement(f"{where}.rtmr{index}", table[f"rtmr{index}"]) if f"rtmr{index}" in table else None
                  for index in range(4))
    return LaunchReference(tee, code.lower(), measurement, rtmrs)  # type: ignore[arg-type]


def _measurement(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _HEX_MEASUREMENT.fullmatch(value.lower()):
        raise InvalidValueError(f"{where} must be a 48-byte measurement: 96 hexadecimal digits")
    return value.lower()


def subset_of(*allowed: str) -> Reader:
    def read(where: str, value: Any) -> tuple[str, ...]:
        items = _string_list(where, value)
        unknown = [item for item in items if item not in allowed]
        if unknown or len(set(items)) != len(items):
            raise InvalidValueError(f"{where} must list distinct values from {list(allowed)}")
        return tuple(sorted(items))

    return read


def audit_sink(where: str, value: Any) -> str:
    if value == "stderr":
        return value
    if isinstance(value, str) and value.startswith("jsonl:") and len(value) > len("jsonl:"):
        return value
    raise InvalidValueError(f"{where} must be \"stderr\" or \"jsonl:<path>\"")


def note_key(where: str, value: Any) -> str:
    """A C2SP note verifier key (name+hash+base64), or "" for none named yet."""
    if not isinstance(value, str) or (value and not _NOTE_KEY.fullmatch(value)):
        raise InvalidValueError(f"{where} must be a C2SP note verifier key (name+hash+base64) or empty")
    return value


def witness_keys(where: str, value: Any) -> tuple[WitnessKey, ...]:
    """Inline tables {name, key}, each name and each key once, sorted by name; key "" is a placeholder."""
    if not isinstance(value, list) or not all(isinstance(item, dict) and set(item) == {"name", "key"}
                                              for item in value):
        raise InvalidValueError(f"{where} must be a list of tables such as {{ name = \"w1\", key = \"w1+...\" }}")
    witnesses = []
    for index, item in enumerate(value):
        if not isinstance(item["name"], str) or not _NAME.fullmatch(item["name"]):
            raise InvalidValueError(f"{where}[{index}].name must be 1-64 lowercase letters, digits or '-'")
        witnesses.append(WitnessKey(item["name"], note_key(f"{where}[{index}].key", item["key"])))
    if len({witness.name for witness in witnesses}) != len(witnesses):
        raise InvalidValueError(f"{where} names a witness twice; list each once")
    # A key's text holds its name and a hash of it: compare the key itself (base64 of type and key, after
    # the second '+'). A cosignature does not cover the witness's name (c2sp.org/tlog-cosignature), so one
    # key under two names would count twice toward the quorum.
    keys = [witness.key.split("+", 2)[2] for witness in witnesses if witness.key]
    if len(set(keys)) != len(keys):
        raise InvalidValueError(f"{where} lists one witness key under two names; each witness needs a key of its own")
    return tuple(sorted(witnesses, key=lambda witness: witness.name))


def _string_list(where: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidValueError(f"{where} must be a list of strings")
    return value
