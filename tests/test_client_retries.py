"""When the SDK sends a request again: each retry's reason and bound, against a real HTTP gateway stand-in.

The stand-in lists one simulated node and answers every `/v1/infer` with the next refusal of a script,
counting directory fetches and posts, so each test sees exactly how often the real `Client` sent.
The policy's own function, `send_with_retries`, is checked on scripted sequences of real errors: for
the clock retry, which needs a node's sealed answer (tests/test_e2e_fleet.py runs it on a real fleet),
and for the most sends one call can make.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Response

from attestation.sim_root import ROOT_DIR_ENV
from client.errors import GatewayError, NodeError, StreamTruncatedError, VeilClientError
from client.retries import MAX_RETRY_AFTER_S, send_with_retries
from client.sdk import Client
from protocol import codes
from tests.http_stand_in import environment, served
from tests.test_client_refusal import _node as simulated_listing


@dataclass(frozen=True)
class Refusal:
    """One answer of the stand-in's `/v1/infer`: a status, an error code and an optional Retry-After."""

    status: int
    code: str
    retry_after: str | None = None


STALE = [Refusal(404, codes.NO_CANDIDATE), Refusal(502, codes.NODE_FAILED), Refusal(400, codes.UNKNOWN_KEY)]
BUSY = Refusal(503, "overloaded", "0.01")


@dataclass
class StandIn:
    """A gateway stand-in: a fixed directory, the refusals still to answer, and what it was asked."""

    directory: dict
    script: list[Refusal] = field(default_factory=list)
    directory_fetches: int = 0
    posts: int = 0
    url: str = ""


def _app(stand_in: StandIn) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/nodes")
    def nodes() -> dict:
        stand_in.directory_fetches += 1
        return stand_in.directory

    @app.post("/v1/infer")
    def infer() -> Response:
        stand_in.posts += 1
        refusal = stand_in.script.pop(0)
        headers = {"retry-after": refusal.retry_after} if refusal.retry_after is not None else None
        return Response(f'{{"error": {{"code": "{refusal.code}", "message": "refused"}}}}',
                        status_code=refusal.status, media_type="application/json", headers=headers)

    return app


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    root = tmp_path_factory.mktemp("retries")
    state = StandIn({"version": 1, "nodes": [simulated_listing(root)], "policy_digest": ""})
    with served(_app(state)) as url, environment(ROOT_DIR_ENV, str(root)):
        state.url = url
        yield state


def _refused(stand_in: StandIn, script: list[Refusal], max_retries: int = 2) -> tuple[GatewayError, int, int]:
    """The error one request ends with after `script`, with the posts and directory fetches it took."""
    stand_in.script = list(script)
    posts, fetches = stand_in.posts, stand_in.directory_fetches
    with Client(stand_in.url, policy="dev", max_retries=max_retries, directory_ttl_s=3600) as client, \
            pytest.raises(GatewayError) as caught:
        client.completions.create(model="tiny", prompt="a question")
    assert stand_in.script == []  # every scripted refusal was asked for, none more
    return caught.value, stand_in.posts - posts, stand_in.directory_fetches - fetches


@pytest.mark.parametrize("stale", STALE, ids=lambda refusal: refusal.code)
def test_a_stale_directory_is_fetched_again_once_then_the_refusal_is_raised(stand_in: StandIn,
                                                                            stale: Refusal) -> None:
    error, posts, fetches = _refused(stand_in, [stale, stale])
    assert (error.status, error.code) == (stale.status, stale.code)
    assert posts == 2 and fetches == 2  # the cache would last an hour: the second fetch is the retry's


def test_an_overloaded_gateway_is_asked_max_retries_more_times(stand_in: StandIn) -> None:
    error, posts, fetches = _refused(stand_in, [BUSY] * 4, max_retries=3)
    assert error.status == 503 and error.retry_after == 0.01
    assert posts == 4 and fetches == 1


def test_a_wait_for_the_gateway_gives_the_directory_retry_its_bound_again(stand_in: StandIn) -> None:
    stale = STALE[1]
    error, posts, fetches = _refused(stand_in, [stale, BUSY, stale, stale], max_retries=2)
    assert (error.status, error.code) == (stale.status, stale.code)
    assert posts == 4 and fetches == 3


@pytest.mark.parametrize("refusal", [
    Refusal(400, codes.UNDECRYPTABLE),  # sending the same bytes again cannot help
    Refusal(504, codes.NODE_TIMEOUT),  # the node may still run it
    Refusal(503, "overloaded"),  # no Retry-After: the gateway did not say when
    Refusal(503, "overloaded", str(MAX_RETRY_AFTER_S + 1)),  # too long a wait: the caller decides
], ids=["undecryptable", "node_timeout", "busy_without_retry_after", "busy_too_long"])
def test_every_other_gateway_refusal_is_raised_at_once(stand_in: StandIn, refusal: Refusal) -> None:
    error, posts, fetches = _refused(stand_in, [refusal])
    assert (error.status, error.code) == (refusal.status, refusal.code)
    assert posts == 1 and fetches == 1


# ----- the policy's function on its own -----------------------------------------------------------------


def _clock_refusal() -> NodeError:
    return NodeError(400, codes.DATE_OUT_OF_WINDOW, "node", node_time=1234.5)


def _stale() -> GatewayError:
    return GatewayError(502, codes.NODE_FAILED, "refused")


def _busy() -> GatewayError:
    return GatewayError(503, "overloaded", "refused", retry_after=0.0)


@dataclass
class Script:
    """A `send` that raises the scripted errors in turn, then answers; and what the retries did in between."""

    errors: list[VeilClientError]
    sends: int = 0
    clock: list[float] = field(default_factory=list)
    refetches: int = 0

    def send(self) -> str:
        self.sends += 1
        if self.errors:
            raise self.errors.pop(0)
        return "answer"

    def run(self, max_retries: int) -> str:
        return send_with_retries(self.send, max_retries, correct_clock=self.clock.append,
                                 refetch_directory=self._refetch)

    def _refetch(self) -> None:
        self.refetches += 1


def test_the_most_one_call_sends_is_two_by_max_retries_plus_one_by_two() -> None:
    # Each retry used as often as its bound allows, inner ones starting afresh after each outer one.
    inner = [_stale(), _busy(), _stale()]
    most = Script([*inner, _clock_refusal(), *inner])
    assert most.run(max_retries=1) == "answer"
    assert most.sends == 2 * (1 + 1) * 2
    assert most.clock == [1234.5] and most.refetches == 4
    one_more = Script([*inner, _clock_refusal(), *inner, _stale()])
    with pytest.raises(GatewayError):
        one_more.run(max_retries=1)
    assert one_more.sends == 8 and one_more.errors == []


def test_the_clock_is_corrected_once_and_only_from_a_node_that_sent_its_date() -> None:
    twice = Script([_clock_refusal(), _clock_refusal()])
    with pytest.raises(NodeError):
        twice.run(max_retries=2)
    assert twice.sends == 2 and twice.clock == [1234.5]
    undated = Script([NodeError(400, codes.DATE_OUT_OF_WINDOW, "node", node_time=None)])
    with pytest.raises(NodeError):
        undated.run(max_retries=2)
    assert undated.sends == 1 and undated.clock == []


@pytest.mark.parametrize("error", [
    NodeError(500, "engine_failed", "node"),  # the node read the request: it may have run it
    StreamTruncatedError("node"),  # likewise, and it may have run to its end
    GatewayError(0, "unreachable", "not sent"),  # the caller decides whether the gateway is worth asking again
], ids=["node_error", "truncated", "unreachable"])
def test_every_other_error_is_raised_at_once(error: VeilClientError) -> None:
    script = Script([error])
    with pytest.raises(type(error)):
        script.run(max_retries=2)
    assert script.sends == 1 and script.clock == [] and script.refetches == 0
