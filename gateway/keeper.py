"""Keeps the pool true: admits nodes, re-attests them on a timer, health-checks and evicts them.

Runs in the gateway's event loop. Each round (every `health_s`) it evicts
expired evidence, health-checks every admitted node (evicting the silent and
the draining, re-attesting at once a node whose id changed because it rotated
its key), re-attests nodes whose timer is due, and retries admission of every
known node that is not in the pool and reports itself serving: a node whose
engine core died still answers Attest, so attesting alone would readmit it.
Evidence is verified off the event loop. The known nodes are the `--node` addresses and, with
`--node-dns`, every address the names resolve to (`gateway.discovery`): a new one is attested
before admission as any other, one no longer listed is evicted and forgotten.

A node's answers can only get that node refused. Whatever verifying its
evidence raises, even an exception the verifier should have turned into an
AttestationError, refuses (or evicts) that node alone, with a fixed message:
the gateway still starts, the round goes on for the other nodes, and a
registration is refused, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from audit.events import EvictionReason
from gateway.audit import GatewayAuditor
from gateway.errors import AdmissionError, NodeUnreachableError, RegistrationError
from gateway.discovery import NodeDiscovery, Resolver, resolve_addresses
from gateway.node_client import AttestAnswer, NodeClient
from gateway.pool import Admission, Eviction, HealthVerdict, NodePool, eviction_reason
from gateway.settings import GatewaySettings
from serving.errors import MalformedRequestError, SettingsError
from serving.settings import parse_address

_log = logging.getLogger("veil.gateway")
MAX_KNOWN_NODES = 1024
_VERDICT_REASONS = {HealthVerdict.UNREACHABLE: EvictionReason.UNREACHABLE, HealthVerdict.DRAINED: EvictionReason.DRAINED}
NOT_SERVING = "the node reports that it is not serving; it is admitted once it serves again"
_NOT_ADMITTED = "the node could not be attested and admitted; check its evidence and policy"
_UNREACHABLE = "does not answer its health check; retrying every health round"


class PoolKeeper:
    """Owns the node channels and every change to the pool."""

    def __init__(self, settings: GatewaySettings, pool: NodePool, auditor: GatewayAuditor,
                 resolver: Resolver = resolve_addresses) -> None:
        self.settings = settings
        self.pool = pool
        self.auditor = auditor
        self._known: list[str] = list(dict.fromkeys(settings.nodes))
        self.discovery = NodeDiscovery(settings.node_dns, settings.dns_refresh_s, resolver)
        self._discovered: set[str] = set()
        self._clients: dict[str, NodeClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refusals: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def client(self, address: str) -> NodeClient:
        """The channel to `address` (created on first use)."""
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = NodeClient(address)
        return client

    async def start(self) -> None:
        """Try to admit the configured nodes (bounded wait), then run the upkeep loop."""
        if self._known or self.settings.node_dns:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.run_round(), self.settings.startup_admission_s)
        self._task = asyncio.create_task(self._loop(), name="veil-gateway-keeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def run_round(self) -> None:
        """One upkeep round over every known node; one node's surprise never ends it for the others."""
        await self._discover()
        for eviction in self.pool.expire():
            self._record(eviction)
        due = set(self.pool.reattestation_due(self.settings.reattest_s, margin_s=2 * self.settings.health_s))
        addresses = list(self._known)
        outcomes = await asyncio.gather(*(self._upkeep(address, address in due) for address in addresses),
                                        return_exceptions=True)
        for address, outcome in zip(addresses, outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Its type only: a message could quote what the node sent.
                _log.error("veil gateway: upkeep of the node at %s failed (%s); retrying next round",
                           address, type(outcome).__name__)

    async def admit(self, address: str) -> Admission:
        """Admit `address` if it serves and attests over a fresh nonce, or raise (evicting it if it was admitted)."""
        async with self._lock_for(address):
            if self.pool.entry_at(address) is None:
                return await self._join(address)
            return await self._attest(address)

    async def register(self, address: str) -> Admission:
        """Admit a node that asked to join; remember it for upkeep only once it verified."""
        try:
            parse_address(address)
        except SettingsError:
            raise MalformedRequestError("a node registers with {\"address\": \"HOST:PORT\"}") from None
        if address not in self._known and len(self._known) >= MAX_KNOWN_NODES:
            raise RegistrationError("this gateway knows as many nodes as it can keep; register later")
        try:
            admission = await self.admit(address)
        except AdmissionError as error:
            raise RegistrationError(NOT_SERVING if error.check == "health" else _NOT_ADMITTED) from None
        except NodeUnreachableError:
            raise RegistrationError(_NOT_ADMITTED) from None
        if address not in self._known:
            self._known.append(address)
        return admission

    async def _discover(self) -> None:
        """Follow the --node-dns names: a new address is known from now on (and attested before admission,
        as any node); an address no longer listed is evicted and forgotten, unless --node names it too."""
        found = await self.discovery.due_addresses()
        if found is None:
            return
        for address in sorted(found - self._discovered):
            if address not in self._known and len(self._known) < MAX_KNOWN_NODES:
                self._known.append(address)
                _log.info("veil gateway: discovered a node address %s", address)
        for address in self._discovered - found:
            if address not in self.settings.nodes:
                self._known.remove(address)
                self._refusals.pop(address, None)
                self._evict(address, EvictionReason.DRAINED)
        self._discovered = found & set(self._known)

    def report_failure(self, address: str) -> None:
        """An inference failed at `address`: evict it until a fresh attestation readmits it."""
        self._evict(address, EvictionReason.UNREACHABLE)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_s)
            try:
                await self.run_round()
            except Exception:  # the loop must outlive any one round's surprise
                _log.exception("veil gateway: pool upkeep round failed; retrying next round")

    async def _upkeep(self, address: str, reattest_due: bool) -> None:
        lock = self._lock_for(address)
        if lock.locked():
            return  # an admission is already under way there
        async with lock:
            if self.pool.entry_at(address) is None:
                with contextlib.suppress(AdmissionError, NodeUnreachableError):
                    await self._join(address)
                return
            verdict = await self._health(address)
            if verdict in _VERDICT_REASONS:
                self._evict(address, _VERDICT_REASONS[verdict])
            elif verdict is HealthVerdict.KEY_ROTATED or reattest_due:
                await self._try_attest(address)

    async def _health(self, address: str) -> HealthVerdict:
        try:
            report = await self.client(address).health(self.settings.health_timeout_s)
        except NodeUnreachableError:
            report = None
        return self.pool.judge_health(address, report)

    async def _join(self, address: str) -> Admission:
        """Admit a node that is not in the pool: only if its health check says it serves, then on its evidence."""
        verdict = await self._health(address)
        if verdict is HealthVerdict.UNREACHABLE:
            if self._refusals.get(address) != _UNREACHABLE:  # said once while it stays silent, not every round
                self._refusals[address] = _UNREACHABLE
                _log.warning("veil gateway: node at %s %s", address, _UNREACHABLE)
            raise NodeUnreachableError("the node did not answer the health check")
        if verdict is HealthVerdict.DRAINED:
            error = AdmissionError(NOT_SERVING, check="health")
            self._refused(address, error, was_admitted=False)
            raise error
        return await self._attest(address)

    async def _try_attest(self, address: str) -> None:
        with contextlib.suppress(AdmissionError, NodeUnreachableError):
            await self._attest(address)

    async def _attest(self, address: str) -> Admission:
        was_admitted = self.pool.entry_at(address) is not None
        nonce = self.pool.challenge(address)
        try:
            answer = await self.client(address).attest(nonce, self.settings.attest_timeout_s)
            admission = await asyncio.to_thread(self._verify_and_admit, address, answer)
        except AdmissionError as error:
            self._refused(address, error, was_admitted)
            raise
        except NodeUnreachableError:
            self._evict(address, EvictionReason.UNREACHABLE)
            raise
        self._refusals.pop(address, None)
        if not was_admitted or admission.previous_id is not None:
            self.auditor.admitted(admission)
            _log.info("veil gateway: admitted node %s… at %s", admission.entry.node_id[:12], address)
        return admission

    def _verify_and_admit(self, address: str, answer: AttestAnswer) -> Admission:
        """`pool.admit`, with anything else than AdmissionError it raises made that node's refusal."""
        try:
            return self.pool.admit(address, answer.evidence, answer.capacity, answer.models, answer.transparency,
                                   task=answer.task)
        except AdmissionError:
            raise
        except Exception as error:
            # Only the node's bytes differ between this node and the others, so this refuses the node;
            # the exception's type names the fault, its message (which could quote them) is dropped.
            raise AdmissionError(f"the node's evidence could not be verified: the verifier raised "
                                 f"{type(error).__name__} on it", check="format") from None

    def _refused(self, address: str, error: AdmissionError, was_admitted: bool) -> None:
        if was_admitted:
            self._evict(address, eviction_reason(error))
        elif self._refusals.get(address) != error.message:
            # Said once per reason, not every round, while the node keeps failing the same way.
            self._refusals[address] = error.message
            _log.warning("veil gateway: node at %s not admitted: %s", address, error.message)

    def _evict(self, address: str, reason: EvictionReason) -> None:
        eviction = self.pool.evict(address, reason)
        if eviction is not None:
            self._record(eviction)

    def _record(self, eviction: Eviction) -> None:
        self.auditor.evicted(eviction)
        _log.warning("veil gateway: evicted node %s… at %s (%s)", eviction.node_id[:12], eviction.address,
                     eviction.reason.value)

    def _lock_for(self, address: str) -> asyncio.Lock:
        lock = self._locks.get(address)
        if lock is None:
            lock = self._locks[address] = asyncio.Lock()
        return lock
