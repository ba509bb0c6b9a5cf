"""The node's side of the transparency log: it logs its key statement and staples its proofs.

At start and after each key rotation the node appends the statement of the OHTTP key it serves
through the operator's log (`veil log serve --key`), which appends it only with this node's evidence
over the statement. It then fetches tlog-proofs for its release statement and its key statement and
serves them with its evidence (AttestResponse.transparency_proofs). A background thread refreshes
them as the log grows and witnesses cosign: never on the request path, each exchange bounded by a
timeout, and after a failure again with backoff (RETRY_S, doubling up to refresh_s), every wait spread by
±JITTER so that a fleet started together, or cut off by the same log outage, does not ask in step. Each attempt is
reported (`on_refresh`: the node's `proofs_refreshed` audit event and metric) with how fresh the stapled
proofs are then (`enclave.proof_expiry`), a failed one also as a line `veil node` logs, so a log outage is seen well
before clients refuse the node. What leaves the node is the statement and its evidence, both public by design.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from attestation.measurement import Measurement
from attestation.transparency.client_check import TransparencyRequirement, parse_bundle
from attestation.transparency.errors import NotLoggedError, TransparencyError
from attestation.transparency.node_append import APPEND_PATH, AppendRequest, append_nonce
from attestation.transparency.statements import NodeKeyStatement, encode_statement
from audit.events import ProofFreshness, ProofRefreshOutcome
from enclave.proof_expiry import freshness, proofs_expire_at


CLOCK_ALLOWANCE_S = 60  # a statement's window starts this early, for clients whose clocks run behind
UNROTATED_KEY_WINDOW_S = 86_400  # a key that is never rotated is logged for a day at a time, then again
EXCHANGE_TIMEOUT_S = 30.0  # the log verifies evidence and asks its witnesses before it answers an append
RETRY_S = 5.0  # after a failed refresh, the next comes this soon, then twice as late each time (at most refresh_s)
JITTER = 0.2  # each wait is its schedule's value times a draw from [1 - JITTER, 1 + JITTER]
NOT_READY = frozenset({ProofFreshness.EXPIRING, ProofFreshness.EXPIRED})
OnRefresh = Callable[[ProofRefreshOutcome, ProofFreshness], None]


def retry_delay_s(failures: int, refresh_s: float) -> float:
    """How long to wait before the next refresh after `failures` failed ones in a row (0: the regular wait)."""
    if failures <= 0:
        return refresh_s
    return min(refresh_s, RETRY_S * 2 ** min(failures - 1, 32))


def jittered(delay_s: float, rng: random.Random) -> float:
    """`delay_s` spread by ±JITTER: nodes on the same schedule drift apart instead of asking the log together."""
    return delay_s * rng.uniform(1 - JITTER, 1 + JITTER)


def node_key_statement(key_config: bytes, measurement: Measurement, now: float, lifetime_s: float,
                       receipt_key: bytes) -> NodeKeyStatement:
    """The statement the node logs for the key configuration it serves: valid from now for `lifetime_s`,
    with the receipt key its evidence binds beside it (so a third party can check its receipts)."""
    not_before = max(0, int(now) - CLOCK_ALLOWANCE_S)
    return NodeKeyStatement(
        key_config_digest=hashlib.sha256(key_config).hexdigest(),
        measurement=measurement.digest().hex(),
        not_before=not_before,
        not_after=int(now + lifetime_s) + CLOCK_ALLOWANCE_S,
        receipt_key=receipt_key.hex(),
    )


@dataclass(frozen=True, slots=True)
class Logged:
    key_config: bytes
    statement: NodeKeyStatement
    index: int


class TransparencyStapler:
    """Logs the node's key and keeps the proofs it staples fresh (thread-safe; `proofs` is what Attest sends)."""

    def __init__(self, log_url: str, measurement: Measurement, key_config: Callable[[], bytes],
                 attest: Callable[[bytes], str], key_lifetime_s: float, refresh_s: float,
                 receipt_key: bytes, requirement: TransparencyRequirement | None = None,
                 on_refresh: OnRefresh = lambda outcome, proofs: None, clock: Callable[[], float] = time.time) -> None:
        self.log_url = log_url.rstrip("/")
        self.measurement = measurement
        self._key_config = key_config
        self._attest = attest
        self.key_lifetime_s = key_lifetime_s if key_lifetime_s > 0 else UNROTATED_KEY_WINDOW_S
        self.refresh_s = refresh_s
        self.receipt_key = receipt_key
        self._logged: Logged | None = None
        self._proofs = ""
        self.last_error: str | None = None  # why the last refresh failed, None after one that worked
        self.failures = 0  # failed refreshes in a row
        self.requirement = requirement  # the policy's: how old clients let the proofs be (None: no age applies)
        self._on_refresh = on_refresh
        self._clock = clock
        self._expire_at: float | None = None  # when clients start refusing the proofs stapled now
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._rng = random.Random()  # spreads the waits only: nothing secret is drawn from it
        self.next_wait_s = jittered(refresh_s, self._rng)  # until the next refresh, as the schedule last set it

    @property
    def logged_index(self) -> int | None:
        """The log index of the key statement of the key served now, None until it is logged."""
        logged = self._logged
        return logged.index if logged is not None and logged.key_config == self._key_config() else None

    @property
    def proofs(self) -> str:
        """The proof bundle (JSON) for the key served now; "" until one is logged and proved."""
        with self._lock:
            return self._proofs

    @property
    def freshness(self) -> ProofFreshness:
        """How fresh the stapled proofs are now (NONE without proofs, or where the policy asks for no witness)."""
        if self.requirement is None or not self.proofs:
            return ProofFreshness.NONE
        return freshness(self._expire_at, self._clock(), self.requirement.max_age_s)

    @property
    def ready(self) -> bool:
        """False once the stapled proofs are in the last tenth of their allowed age: clients are about to refuse them."""
        return self.freshness not in NOT_READY

    def refresh(self) -> None:
        """Log the served key if it is not (or its window nears its end), then fetch both proofs."""
        with httpx.Client(timeout=EXCHANGE_TIMEOUT_S, trust_env=False) as http:
            logged = self._ensure_logged(http)
            release = self._release_index(http)
            parts = {"release": None if release is None else self._proof(http, release),
                     "node_key": self._proof(http, logged.index)}
        bundle = parse_bundle(json.dumps(parts))  # what the client will parse: refuse to serve anything else
        expire_at = None if self.requirement is None else proofs_expire_at(bundle, self.requirement)
        with self._lock:
            self._proofs = bundle.to_json() if self._key_config() == logged.key_config else ""
            self._expire_at = expire_at
        if release is None:  # the key's proof is stapled; the release's is looked for again soon
            raise NotLoggedError("no release statement in the log lists this node's code, policy and model")

    def key_rotated(self) -> None:
        """The node serves a new key: log it and refresh the proofs now, on the stapler's thread."""
        with self._lock:
            self._proofs = ""  # the old key's proofs would only get the node refused
        self._wake.set()

    def start(self) -> None:
        threading.Thread(target=self._run, name="veil-transparency", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.next_wait_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.refresh_quietly()

    def refresh_quietly(self) -> bool:
        """`refresh()`; True if it worked, else False with `last_error` saying why (the log's word or the
        exchange's type, nothing else). Either way reported to `on_refresh`; a failure also logged."""
        try:
            self.refresh()
        except (TransparencyError, httpx.HTTPError) as error:
            self.last_error = str(error) if isinstance(error, TransparencyError) else type(error).__name__
            self.failures += 1
            self.next_wait_s = jittered(retry_delay_s(self.failures, self.refresh_s), self._rng)
            self._report(_outcome(error))
            return False
        self.last_error, self.failures = None, 0
        self.next_wait_s = jittered(self.refresh_s, self._rng)
        self._report(ProofRefreshOutcome.OK)
        return True

    def _report(self, outcome: ProofRefreshOutcome) -> None:
        self._on_refresh(outcome, self.freshness)

    def failure_line(self, outcome: ProofRefreshOutcome, proofs: ProofFreshness) -> tuple[bool, str] | None:
        """For the operator's log (the command line writes it: the node itself logs nothing): whether a failed
        refresh is serious (the proofs are about to expire or have) and its line; None after a success."""
        if outcome is ProofRefreshOutcome.OK:
            return None
        return proofs in NOT_READY, (
            f"veil node: transparency proofs not refreshed ({outcome.value}: {self.last_error}); the stapled proofs "
            f"are {proofs.value}; retrying in {self.next_wait_s:.0f} s")

    def _ensure_logged(self, http: httpx.Client) -> Logged:
        key_config, now = self._key_config(), time.time()
        logged = self._logged
        renew_at = None if logged is None else logged.statement.not_after - CLOCK_ALLOWANCE_S - self.key_lifetime_s / 4
        if logged is not None and logged.key_config == key_config and now < renew_at:
            return logged
        statement = node_key_statement(key_config, self.measurement, now, self.key_lifetime_s, self.receipt_key)
        entry = encode_statement(statement)
        request = AppendRequest(entry, self._attest(append_nonce(entry)))
        answer = self._call(http.post(f"{self.log_url}{APPEND_PATH}", content=request.to_json(),
                                      headers={"content-type": "application/json"}), "append the key statement")
        index = answer.get("index")
        if type(index) is not int or index < 0:
            raise TransparencyError("the log's answer to an append names no entry index")
        self._logged = Logged(key_config, statement, index)
        return self._logged

    def _release_index(self, http: httpx.Client) -> int | None:
        digests = {"code": self.measurement.code_digest.hex(), "policy": self.measurement.policy_digest.hex(),
                   "model": self.measurement.model_digest.hex()}
        answer = http.get(f"{self.log_url}/release-index", params=digests)
        if answer.status_code == 404:
            return None  # no release lists this node: it staples its key alone, and clients say so
        index = self._call(answer, "find this node's release").get("index")
        if type(index) is not int or index < 0:
            raise TransparencyError("the log's release lookup names no entry index")
        return index

    def _proof(self, http: httpx.Client, index: int) -> dict:
        return self._call(http.get(f"{self.log_url}/proof/{index}"), "prove an entry")

    @staticmethod
    def _call(answer: httpx.Response, what: str) -> dict:
        if answer.status_code != 200:
            raise TransparencyError(f"the log refused to {what} ({answer.status_code}: {_reason(answer)})")
        try:
            value = answer.json()
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise TransparencyError(f"the log's answer to {what} is not a JSON object")
        return value


def _outcome(error: Exception) -> ProofRefreshOutcome:
    if isinstance(error, httpx.HTTPError):
        return ProofRefreshOutcome.LOG_UNREACHABLE
    if isinstance(error, NotLoggedError):
        return ProofRefreshOutcome.RELEASE_NOT_LOGGED
    return ProofRefreshOutcome.LOG_REFUSED


def _reason(answer: httpx.Response) -> str:
    try:
        reason = answer.json().get("error")
        if isinstance(reason, dict):  # the shape of the log's overload refusal, the gateway's errors'
            reason = reason.get("message")
    except (ValueError, AttributeError):
        reason = None
    return reason if isinstance(reason, str) and len(reason) < 300 and reason.isprintable() else "no reason given"
