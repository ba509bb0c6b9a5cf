"""`veil demo` (what `make demo` runs): a local fleet, a few encrypted requests, what was verified, the audit.

Everything runs on loopback with SIMULATED attestation, the development policy
and, unless `--model` names another folder, the shipped trained model
(stories260K, `veil.models`): a 260K-parameter Llama trained on children's
stories. It is a base model, which continues text rather than answering
questions, so every prompt is the opening of a story, completions as well as
chats, and the first answer is greedy: the story `transformers` writes from the
same folder. By default the whole anonymous path runs:
the client obtains Privacy Pass tokens blindly from the fleet's issuer and
sends each request, with one token, through an OHTTP relay, from an address
of its own (127.0.0.3) that the gateway never sees. The fleet runs a transparency log and two
witnesses, and the client refuses any node whose release and key it cannot find in the log,
cosigned by both (the demo prints that check per node).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from attestation.sim_root import ROOT_DIR_ENV
from client.sdk import Client
from client.tokens import TokenWallet
from client.types import ChatCompletionChunk
from veil.route_report import describe_route
from veil.demo_transparency import print_transparency
from veil.fleet import Fleet, FleetSettings
from veil.fleet_access import RELAY_ADDRESS

# Story openings: the shipped model is a base model that continues text (see the module's docstring).
GREEDY_PROMPT = "Once upon a time"  # a completion at temperature 0: tests hold it to transformers' story
GREEDY_TOKENS = 96
SAMPLED_PROMPT = "One day, a little dog named Max"
CHAT_PROMPT = "Lily and Ben went to the park. They saw"  # a chat: the template writes it as plain text
STREAMED_PROMPT = "Tom had a red boat. One day,"
STORY_WIDTH = 76
_BAR = "=" * 78
DEMO_ACCOUNT = "demo"
CLIENT_ADDRESS = "127.0.0.3"  # a loopback address of the client's own, unlike the relay's


class CountingWallet(TokenWallet):
    """A wallet that counts the tokens it handed out and keeps the first, to show that it is refused again."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.spent = 0
        self.first: str | None = None

    def authorization(self) -> str:
        value = super().authorization()
        self.spent += 1
        self.first = self.first or value
        return value


def run_demo(nodes: int = 3, model_dir: Path | None = None, tokens: bool = True, relay: bool = True) -> int:
    """Start a fleet, send four encrypted requests (one streamed), print routes, checks, the anonymous path
    (tokens and relay) and the audit summary."""
    started = time.monotonic()
    _banner()
    with tempfile.TemporaryDirectory(prefix="veil-demo-") as workdir:
        root = Path(workdir)
        # Each node gets one torch thread: on a small machine N nodes then share the cores fairly.
        settings = FleetSettings(nodes=nodes, model_dir=model_dir, workdir=root / "fleet", torch_threads=1,
                                 tokens=tokens, relay=relay, account=DEMO_ACCOUNT, transparency=True)
        fleet = Fleet(settings)
        extras = [name for name, wanted in (("a token issuer", tokens), ("a relay", relay)) if wanted]
        extras.append("a transparency log with two witnesses")
        print(f"starting {nodes} node(s), {', '.join(['a gateway', *extras])} on loopback ...", flush=True)
        with fleet:
            os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)  # the dev policy trusts this fleet's simulated root
            print(f"gateway {fleet.gateway_url} admitted {nodes} attested node(s) "
                  f"in {time.monotonic() - started:.1f} s\n", flush=True)
            address = _own_loopback_address() if relay else None
            wallet = fleet.token_wallet(kind=CountingWallet) if tokens else None
            with _client_http(fleet.client_url, address) as http, \
                    Client(fleet.client_url, policy=fleet.policy, tokens=wallet, http=http) as client:
                _requests(client, model_dir)
                print_transparency(fleet.gateway_url, client.policy)
                _anonymous_path(fleet, http, address, wallet)
        audit_files = sorted((root / "fleet" / "audit").glob("*.jsonl"))
        _audit_summary(audit_files)
    print(f"\nfleet stopped cleanly; demo took {time.monotonic() - started:.1f} s")
    return 0


def _own_loopback_address() -> str | None:
    """CLIENT_ADDRESS if this system routes it to loopback (Linux does), else None."""
    with socket.socket() as probe:
        try:
            probe.bind((CLIENT_ADDRESS, 0))
        except OSError:
            return None
    return CLIENT_ADDRESS


def _client_http(url: str, address: str | None) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=address) if address else None
    return httpx.Client(base_url=url, timeout=60.0, trust_env=False, transport=transport)


def _anonymous_path(fleet: Fleet, http: httpx.Client, address: str | None, wallet: CountingWallet | None) -> None:
    """What the tokens and the relay did, each said in one line, with one refused request as proof."""
    if wallet is not None:
        replayed = http.post("/v1/infer", json={"candidates": []}, headers={"authorization": wallet.first or ""})
        print(f"tokens: {wallet.spent + len(wallet)} obtained blindly from the issuer at {fleet.issuer_url} "
              f"(account {fleet.account.name!r}),\n  {wallet.spent} spent, one per request; the gateway never learns "
              f"the account; a replayed token got {_refusal(replayed)}")
    if fleet.relay is None:
        return
    if address is None:
        print(f"relay: every request went through the relay at {fleet.relay_url}; this system has no second "
              f"loopback address, so the client shares the relay's address {RELAY_ADDRESS}")
        return
    with _client_http(fleet.gateway_url, address) as direct:
        refused = direct.post("/v1/infer", json={"candidates": []})
    print(f"relay: every request went through the relay at {fleet.relay_url} from {address};\n  the gateway saw "
          f"only the relay's address {RELAY_ADDRESS}: it takes requests for nodes from no other "
          f"(a direct one from {address} got {_refusal(refused)})")


def _refusal(response: httpx.Response) -> str:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "no error code"
    return f"{response.status_code} {code}"


def _banner() -> None:
    print(_BAR)
    print("Veil demo: attested, end-to-end encrypted inference on a local fleet")
    print("!! ATTESTATION IS SIMULATED and the policy is 'dev': nothing protects these nodes.")
    print("!! A real fleet runs on H100/H200 GPUs in confidential-computing mode under the strict policy.")
    print(_BAR, flush=True)


def _requests(client: Client, model_dir: Path | None) -> None:
    model = client.models.list().data[0].id
    print(f"model served by the fleet: {model!r} {_about_model(model_dir)}\n")
    greedy = client.completions.create(model=model, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS, temperature=0)
    _show("completion, greedy", GREEDY_PROMPT, greedy.choices[0].text, greedy)
    sampled = client.completions.create(model=model, prompt=SAMPLED_PROMPT, max_tokens=64, temperature=0.8, seed=7)
    _show("completion, sampled with seed 7", SAMPLED_PROMPT, sampled.choices[0].text, sampled)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                          max_tokens=48, temperature=0.8, seed=1)
    _show("chat", CHAT_PROMPT, chat.choices[0].message.content, chat)
    print(f"[streamed chat]\n    {STREAMED_PROMPT}", end="", flush=True)
    with client.chat.completions.create(model=model, messages=[{"role": "user", "content": STREAMED_PROMPT}],
                                        stream=True, max_tokens=48, temperature=0.8, seed=11) as stream:
        print_streamed(stream)
        print(f"\n  served by node {stream.route.node_id[:16]} "
              f"(chosen by the gateway among {_verified(stream.route)} verified candidate(s))\n")
    print("what the client verified itself for the greedy completion (never trusting the gateway):")
    print(describe_route(greedy.route, compact=True))


def _about_model(model_dir: Path | None) -> str:
    if model_dir is not None:
        return f"(from {model_dir})"
    return ("(stories260K, shipped with Veil: a 260K-parameter Llama trained on children's stories.\n"
            "It is a base model, which continues text, so each prompt below is a story's opening, chats too;\n"
            "the first story is greedy, the others sampled. Serve another model with --model DIR.)")


def print_streamed(chunks: Iterable[ChatCompletionChunk]) -> None:
    """Prints a streamed answer as it comes, escaped like the whole answers: a model's output may hold
    control bytes, which must not reach the terminal as commands."""
    for chunk in chunks:
        text = "".join(choice.delta.content or "" for choice in chunk.choices)
        print(escaped(text), end="", flush=True)


def escaped(text: str) -> str:
    """`text` with every unprintable character written as its Python escape, as `repr` writes it."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _show(label: str, prompt: str, text: str | None, answer: Any) -> None:
    """The prompt and its continuation as one story, wrapped, each paragraph escaped like a streamed answer;
    "…" marks a story cut by max_tokens."""
    print(f"[{label}]")
    story = prompt + (text or "") + ("…" if answer.choices[0].finish_reason == "length" else "")
    for paragraph in story.split("\n"):
        print(textwrap.fill(escaped(paragraph), STORY_WIDTH, initial_indent="    ", subsequent_indent="    "))
    route = answer.route
    print(f"  served by node {route.node_id[:16]} (chosen by the gateway among {_verified(route)} verified candidate(s))\n")


def _verified(route: object) -> int:
    return sum(1 for record in route.candidates if record.ok)


def _audit_summary(paths: list[Path]) -> None:
    print(f"\n{_BAR}\naudit trail (the only data the fleet emits besides ciphertext):")
    if not paths:
        print("no audit files were written")
        return
    try:
        from audit.records import read_audit_files
        from audit.summary import format_summary, summarize
    except ImportError:
        print(f"{len(paths)} audit file(s); install the audit package to summarize them")
        return
    sys.stdout.write(format_summary(summarize(read_audit_files(paths))))
