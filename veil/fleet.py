"""A local fleet on loopback: one `veil gateway` and N `veil node` processes (`veil up`), and on request
a `veil issuer` whose tokens the gateway then demands, a `veil relay` in front of the gateway, and a
transparency log with two witnesses (`veil.fleet_transparency`).

For development, the demo, the end-to-end tests and the benchmark. Nodes run
the shipped trained model (`veil.models`: stories260K) unless given another
folder, under SIMULATED attestation and the development policy: nothing
protects them, and every entry point that starts a fleet says so. Each process
writes its own stdout and stderr to files in the fleet's work folder, next to
its audit file, so that tests can prove none of them holds anything of a request.

Neither this module nor the SDK imports the engine, the node or the gateway's
servers (only the transparency log's files, to create it and log a release):
processes are started as `python -m veil ...`. A random-weight model for
benchmarks is written by `veil model init-tiny DIR` and named as the model folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from attestation.sim_root import ROOT_DIR_ENV, load_or_create_sim_root
from attestation.transparency.errors import TransparencyError
from attestation.transparency.statements import ReleaseStatement
from client.tokens import DEFAULT_BATCH_SIZE, TokenWallet
from transparency.keys import read_signer
from ohttp.privacypass import WELL_KNOWN_PATH
from protocol.constants import DIRECTORY_PATH
from veil.fleet_transparency import (
    WITNESSES,
    FleetLogKeys,
    log_release,
    make_log_keys,
    release_of,
    write_transparency_policy,
)
from veil.fleet_access import (
    FleetError,
    ORIGIN,
    RELAY_ADDRESS,
    FleetAccount,
    printed_key_id,
    write_issuer_config,
    write_policy_listing,
)
from veil.models import shipped_model_dir

_REPO_ROOT = Path(__file__).resolve().parents[1]
_POLL_S = 0.05
W = TypeVar("W", bound=TokenWallet)


@dataclass(slots=True)
class FleetSettings:
    """How to run a local fleet; every path defaults to a fresh temporary work folder."""

    nodes: int = 3
    gateway_port: int = 0
    model_dir: Path | None = None  # default: the shipped trained model (veil.models)
    workdir: Path | None = None  # default: a temporary folder, removed on stop
    sim_root_dir: Path | None = None  # default: <workdir>/sim-root
    policy: str = "dev"
    capacity: int = 8
    kv_cache_gib: float = 0.125
    key_rotation_s: float | None = None
    key_grace_s: float | None = None
    reattest_s: float | None = None
    health_s: float | None = None
    torch_threads: int | None = None  # per node; None keeps torch's default
    start_timeout_s: float = 120.0
    extra_node_args: tuple[str, ...] = ()
    # The model name node i serves (`--model-name`), for a fleet of several models; () keeps the folder's name.
    model_names: tuple[str, ...] = ()
    # More node addresses for the gateway to admit (nodes started elsewhere); not waited for.
    extra_gateway_nodes: tuple[str, ...] = ()
    extra_gateway_args: tuple[str, ...] = ()  # for example --origin and --issuer-directory for tokens
    # CPUs each kind of process may run on (None: any). Benchmarks keep the nodes' cores free of
    # gateway and client work, as separate machines would.
    node_cpus: frozenset[int] | None = None
    gateway_cpus: frozenset[int] | None = None
    # A token issuer with one account (`account`): the fleet's own policy lists the issuer's key, so the
    # gateway demands a Privacy Pass token for every request for a node.
    tokens: bool = False
    account: str = "fleet"
    tokens_per_period: int = 1000
    # An OHTTP relay in front of the gateway, which then takes requests for nodes from the relay's address only.
    relay: bool = False
    relay_target: str | None = None  # where the relay forwards (default: this fleet's gateway)
    extra_relay_args: tuple[str, ...] = ()  # for example --metrics-listen
    # A transparency log (`veil log serve`) and two witnesses (`veil witness`): the fleet's policy requires a
    # quorum of both, the release of its nodes is logged, and each node logs its key and staples its proofs.
    transparency: bool = False
    max_checkpoint_age_s: int = 3600
    cosign_every_s: float = 60.0  # the log asks its witnesses again this often while it does not grow

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 32:
            raise FleetError("a local fleet has 1 to 32 nodes")


@dataclass(slots=True)
class FleetProcess:
    """One process of the fleet and where its output goes."""

    name: str
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    port: int | None = None

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass(slots=True)
class _Paths:
    root: Path
    logs: Path = field(init=False)
    audit: Path = field(init=False)
    run: Path = field(init=False)
    tmp: Path = field(init=False)

    def __post_init__(self) -> None:
        self.logs, self.audit, self.run = self.root / "logs", self.root / "audit", self.root / "run"
        self.tmp = self.root / "tmp"  # every process's TMPDIR, so that tests can inspect what lands there
        for folder in (self.logs, self.audit, self.run, self.tmp):
            folder.mkdir(parents=True, exist_ok=True)


class Fleet:
    """Start with `with Fleet(FleetSettings(nodes=3)) as fleet: Client(fleet.gateway_url, ...)`."""

    def __init__(self, settings: FleetSettings | None = None) -> None:
        self.settings = settings or FleetSettings()
        self._owns_workdir = self.settings.workdir is None
        root = self.settings.workdir or Path(tempfile.mkdtemp(prefix="veil-fleet-"))
        try:
            self.paths = _Paths(root)
        except OSError as error:
            raise FleetError(f"cannot use {root} as the fleet's work folder ({error.strerror})") from None
        self.workdir = root
        self.sim_root_dir = self.settings.sim_root_dir or root / "sim-root"
        self.model_dir = self.settings.model_dir or shipped_model_dir()
        self.nodes: list[FleetProcess] = []
        self.gateway: FleetProcess | None = None
        self.issuer: FleetProcess | None = None
        self.relay: FleetProcess | None = None
        self.log: FleetProcess | None = None
        self.witnesses: list[FleetProcess] = []
        self.log_keys: FleetLogKeys | None = None
        self._releases: list[ReleaseStatement] = []  # logged by this fleet
        self.account: FleetAccount | None = None
        self.issuer_key_ids: tuple[str, ...] = ()
        # The policy every process and the client load: the base policy, or the fleet's own file listing its issuer.
        self.policy = self.settings.policy

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> Fleet:
        """Check the model, start the issuer and nodes, the gateway, then the relay; return once all N nodes
        are admitted."""
        try:
            load_or_create_sim_root(self.sim_root_dir)  # before the nodes, so they share one root
            self._ensure_model()
            deadline = time.monotonic() + self.settings.start_timeout_s
            if self.settings.transparency:
                self._start_witnesses()  # their keys are in the policy the nodes measure
            if self.settings.tokens:
                self.issuer = self._start_issuer()  # its key is in the policy the nodes measure
            if self.settings.transparency:
                self.log = self._start_log(deadline)  # the nodes log their keys through it as they start
            self.nodes = [self._start_node(index) for index in range(self.settings.nodes)]
            for process in self.nodes + ([self.issuer] if self.issuer else []):
                process.port = self._wait_for_port(process, deadline)
            self.gateway = self._start_gateway()
            self.gateway.port = self._wait_for_port(self.gateway, deadline)
            if self.settings.relay:
                self.relay = self._start_relay()
                self.relay.port = self._wait_for_port(self.relay, deadline)
            self.wait_for_pool(self.settings.nodes, deadline - time.monotonic(), at_least=True)
            if self.log is not None:
                self._wait_for_proofs(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the relay, the gateway, the nodes, then the issuer (SIGTERM, then SIGKILL after `timeout_s`);
        remove a temporary work folder."""
        processes = [process for process in (self.relay, self.gateway, *self.nodes, self.issuer, self.log,
                                             *self.witnesses) if process]
        for process in processes:
            if process.alive:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in processes:
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- what callers use -----------------------------------------------------------------

    @property
    def gateway_url(self) -> str:
        return self._url(self.gateway, "the fleet is not running; start it first")

    @property
    def issuer_url(self) -> str:
        return self._url(self.issuer, "the fleet runs no token issuer; start it with tokens=True")

    @property
    def relay_url(self) -> str:
        return self._url(self.relay, "the fleet runs no relay; start it with relay=True")

    @property
    def log_url(self) -> str:
        return self._url(self.log, "the fleet runs no transparency log; start it with transparency=True")

    @property
    def witness_urls(self) -> list[str]:
        return [self._url(witness, "the fleet is not running; start it first") for witness in self.witnesses]

    @property
    def client_url(self) -> str:
        """Where clients send requests: the relay when the fleet runs one, else the gateway."""
        return self.relay_url if self.relay is not None else self.gateway_url

    def token_wallet(self, batch_size: int = DEFAULT_BATCH_SIZE, http: httpx.Client | None = None,
                     kind: type[W] = TokenWallet) -> W:
        """A wallet (of class `kind`) obtaining tokens for this fleet's gateway from its issuer, as its account."""
        if self.account is None:
            raise FleetError("the fleet runs no token issuer; start it with tokens=True")
        return kind(self.issuer_url, self.account.credential, policy=self.policy, origin=ORIGIN,
                    batch_size=batch_size, http=http)

    @property
    def environment(self) -> dict[str, str]:
        """Variables a client of this fleet needs: the simulated root its development policy trusts."""
        return {ROOT_DIR_ENV: str(self.sim_root_dir)}

    def audit_files(self) -> list[Path]:
        return sorted(path for path in self.paths.audit.iterdir() if path.is_file())

    def log_files(self) -> list[Path]:
        return sorted(path for path in self.paths.logs.iterdir() if path.is_file())

    def kill_node(self, index: int) -> None:
        """SIGKILL one node (for failure tests): no clean shutdown, no goodbye."""
        node = self.nodes[index]
        node.popen.kill()
        node.popen.wait()

    def node_index(self, node_id: str, timeout_s: float = 5.0) -> int:
        """Which node process announced `node_id` (from its audit file, which may lag up to a second)."""
        needle = f'"node_id":"{node_id}"'
        deadline = time.monotonic() + timeout_s
        while True:
            for index in range(len(self.nodes)):
                path = self.paths.audit / f"node-{index}.jsonl"
                if path.is_file() and needle in path.read_text(encoding="ascii").replace(" ", ""):
                    return index
            if time.monotonic() >= deadline:
                raise FleetError("no node of this fleet announced that node id")
            time.sleep(0.1)

    def pool_size(self) -> int:
        """How many nodes the gateway's pool holds now."""
        response = httpx.get(f"{self.gateway_url}/v1/health", timeout=5.0)
        response.raise_for_status()
        return int(response.json()["nodes"])

    def wait_for_pool(self, size: int, timeout_s: float = 30.0, at_least: bool = False) -> None:
        """Wait until the gateway's pool holds exactly `size` nodes (or at least `size`)."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            self._check_alive()
            try:
                pool = self.pool_size()
                if pool == size or (at_least and pool > size):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"the gateway's pool did not reach {size} node(s) in time; see {self.paths.logs}")
            time.sleep(0.1)

    # ----- starting processes ----------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, **self.environment)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env["TMPDIR"] = str(self.paths.tmp)
        if self.settings.torch_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.settings.torch_threads)
        return env

    def _ensure_model(self) -> None:
        if (self.model_dir / "config.json").is_file():
            return
        if self.settings.model_dir is not None:
            # A folder the user named is theirs: another model is never served in its place.
            raise FleetError(f"no model in {self.model_dir} (no config.json); name a Hugging Face model folder, "
                             "or leave the model out for the shipped one")
        raise FleetError(f"the shipped model is missing from {self.model_dir}; reinstall veil")

    def _spawn(self, name: str, arguments: list[str], cpus: frozenset[int] | None = None) -> FleetProcess:
        stdout_path, stderr_path = self.paths.logs / f"{name}.out", self.paths.logs / f"{name}.err"
        # A port file left by an earlier fleet in this work folder names a port nobody listens on.
        (self.paths.run / f"{name}.port").unlink(missing_ok=True)
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr, pinned(cpus):
            popen = subprocess.Popen(
                [sys.executable, "-m", "veil", *arguments], stdout=stdout, stderr=stderr,
                stdin=subprocess.DEVNULL, env=self._env(), cwd=self.workdir,
            )
        return FleetProcess(name, popen, stdout_path, stderr_path)

    def _start_issuer(self) -> FleetProcess:
        """Register the account, make a signing key, write the policy listing it, and start `veil issuer`."""
        folder = self.workdir / "issuer"
        shutil.rmtree(folder / "keys", ignore_errors=True)  # a fresh key for each start, even in an old work folder
        folder.mkdir(parents=True, exist_ok=True)
        self.account = FleetAccount.generate(self.settings.account)
        config = write_issuer_config(folder / "issuer.toml", self.account, self.settings.tokens_per_period)
        added = subprocess.run(
            [sys.executable, "-m", "veil", "issuer", "--keys", str(folder / "keys"), "--add-key-not-before", "0"],
            env=self._env(), capture_output=True, text=True, timeout=120,
        )
        if added.returncode != 0:
            raise FleetError(f"veil issuer could not add a signing key: {added.stderr.strip()[-500:]}")
        self.issuer_key_ids = (printed_key_id(added.stdout),)
        self.policy = str(write_policy_listing(self.workdir / "policy.toml", self.policy,
                                               self.issuer_key_ids).resolve())
        return self._spawn("issuer", [
            "issuer", "--config", str(config.resolve()), "--keys", str((folder / "keys").resolve()),
            "--listen", "127.0.0.1:0", "--port-file", str(self.paths.run / "issuer.port")])

    def _start_witnesses(self) -> None:
        """Make the log's and witnesses' keys, write the policy naming them, and start both witnesses."""
        keys = self.log_keys = make_log_keys(self.workdir / "transparency")
        self.policy = str(write_transparency_policy(self.workdir / "policy-transparency.toml", self.policy, keys,
                                                    self.settings.max_checkpoint_age_s).resolve())
        self.witnesses = [self._spawn(WITNESSES[index], [
            "witness", "--key", str(key.resolve()), "--log", keys.log_verifier,
            "--state", str(keys.witness_state(index).resolve()), "--listen", "127.0.0.1:0",
            "--port-file", str(self.paths.run / f"{WITNESSES[index]}.port")]) for index, key in enumerate(keys.witness_keys)]

    def _start_log(self, deadline: float) -> FleetProcess:
        """Log the nodes' release (cosigned by both witnesses), then serve the log for the nodes' keys."""
        keys = self.log_keys
        assert keys is not None, "the witnesses start first"
        for witness in self.witnesses:
            witness.port = self._wait_for_port(witness, deadline)
        self._log_release()
        process = self._spawn("log", [
            "log", "serve", str(keys.log_directory.resolve()), "--key", str(keys.log_key.resolve()),
            "--policy", self.policy, "--cosign-every-s", f"{self.settings.cosign_every_s:g}",
            "--listen", "127.0.0.1:0", "--port-file", str(self.paths.run / "log.port"),
            *(argument for url in self.witness_urls for argument in ("--witness", url))])
        process.port = self._wait_for_port(process, deadline)
        return process

    def _log_release(self) -> None:
        """Log the release of the code, policy and model as measured now, unless it is logged already."""
        assert self.log_keys is not None, "the witnesses start first"
        release = release_of(self.policy, Path(self.model_dir).resolve())
        if release not in self._releases:
            log_release(self.log_keys, read_signer(self.log_keys.log_key), release, self.witness_urls)
            self._releases.append(release)

    def _wait_for_proofs(self, deadline: float) -> None:
        """Wait until the directory lists proofs of its release and key for every node.

        A node's first exchange with the log may have failed (it retries), or its code may have changed on
        disk between the fleet's measurement and its own (a checkout being edited): the fleet then logs the
        release it measures now, as a release process would, and the node finds it when it retries.
        """
        while True:
            self._check_alive()
            try:
                nodes = httpx.get(f"{self.gateway_url}{DIRECTORY_PATH}", timeout=5.0).json()["nodes"]
                if all(json.loads(node.get("transparency") or "{}").get("release") for node in nodes):
                    return
                self._log_release()
            except (httpx.HTTPError, KeyError, ValueError, TypeError, AttributeError, TransparencyError):
                pass  # asked again below, until the deadline
            if time.monotonic() > deadline:
                raise FleetError(f"the gateway lists no proof of its release or key for some node; see {self.paths.logs}")
            time.sleep(0.2)

    def _start_relay(self) -> FleetProcess:
        target = self.settings.relay_target or self.gateway_url
        return self._spawn("relay", ["relay", "--gateway", target, "--listen", "127.0.0.1:0",
                                     "--port-file", str(self.paths.run / "relay.port"),
                                     *self.settings.extra_relay_args], self.settings.gateway_cpus)

    def _access_arguments(self) -> list[str]:
        """The gateway's options for the fleet's issuer and relay."""
        arguments = []
        if self.issuer is not None:
            arguments += ["--origin", ORIGIN, "--issuer-directory", f"{self.issuer_url}{WELL_KNOWN_PATH}",
                          "--spent-tokens", f"sqlite:{(self.workdir / 'spent-tokens.sqlite').resolve()}"]
        if self.settings.relay:
            arguments += ["--relay-only", RELAY_ADDRESS]
        return arguments

    def _start_node(self, index: int) -> FleetProcess:
        s = self.settings
        arguments = [
            "node", "--model", str(Path(self.model_dir).resolve()), "--policy", self.policy, "--attestation", "sim",
            "--listen", "127.0.0.1:0", "--port-file", str(self.paths.run / f"node-{index}.port"),
            "--capacity", str(s.capacity), "--kv-cache-gib", str(s.kv_cache_gib),
            "--audit", f"file:{self.paths.audit / f'node-{index}.jsonl'}",
        ]
        arguments += _optional("--key-rotation-s", s.key_rotation_s) + _optional("--key-grace-s", s.key_grace_s)
        if self.log is not None:
            arguments += ["--transparency-log", self.log_url]
        if s.model_names:
            arguments += ["--model-name", s.model_names[index % len(s.model_names)]]
        return self._spawn(f"node-{index}", arguments + list(s.extra_node_args), s.node_cpus)

    def _start_gateway(self) -> FleetProcess:
        s = self.settings
        arguments = [
            "gateway", "--listen", f"127.0.0.1:{s.gateway_port}", "--policy", self.policy,
            "--port-file", str(self.paths.run / "gateway.port"),
            "--audit", f"file:{self.paths.audit / 'gateway.jsonl'}",
        ]
        for address in [f"127.0.0.1:{node.port}" for node in self.nodes] + list(s.extra_gateway_nodes):
            arguments += ["--node", address]
        # With a log, nodes' proofs reach the directory when the gateway attests them again: soon, in a fleet.
        reattest_s = s.reattest_s if s.reattest_s is not None or self.log is None else 5.0
        arguments += _optional("--reattest-s", reattest_s) + _optional("--health-s", s.health_s)
        arguments += _optional("--key-grace-s", s.key_grace_s) + self._access_arguments() + list(s.extra_gateway_args)
        return self._spawn("gateway", arguments, s.gateway_cpus)

    def _wait_for_port(self, process: FleetProcess, deadline: float) -> int:
        port_file = self.paths.run / f"{process.name}.port"
        while True:
            if port_file.is_file():
                text = port_file.read_text().strip()
                if text.isdigit():
                    return int(text)
            if not process.alive:
                raise FleetError(f"{process.name} exited with status {process.popen.returncode} while starting"
                                 f"{_last_words(process)}")
            if time.monotonic() > deadline:
                raise FleetError(f"{process.name} did not start in time; its messages are in {process.stderr_path}")
            time.sleep(_POLL_S)

    def _url(self, process: FleetProcess | None, missing: str) -> str:
        if process is None:
            raise FleetError(missing)
        if process.port is None:
            raise FleetError("the fleet is not running; start it first")
        return f"http://127.0.0.1:{process.port}"

    def _check_alive(self) -> None:
        if self.gateway is not None and not self.gateway.alive:
            raise FleetError(f"the gateway exited with status {self.gateway.popen.returncode}; "
                             f"its messages are in {self.gateway.stderr_path}")


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Runs the block with the calling thread on `cpus`; threads and processes started in it inherit them.

    CPU affinity is per thread on Linux, so this changes nothing for the caller's other threads.
    """
    if cpus is None:
        yield
        return
    if not hasattr(os, "sched_setaffinity"):
        raise FleetError("pinning processes to CPUs needs Linux (os.sched_setaffinity)")
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def _last_words(process: FleetProcess) -> str:
    """The last line a process wrote to stderr before it exited, to quote in the error.

    The work folder holding the file may be removed with the fleet, so the line is quoted, not
    pointed at. A process that has not served a request has nothing of one to say.
    """
    try:
        lines = process.stderr_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return f": {lines[-1][:500]}" if lines else f"; its messages are in {process.stderr_path}"


def _optional(flag: str, value: float | None) -> list[str]:
    return [] if value is None else [flag, f"{value:g}"]
