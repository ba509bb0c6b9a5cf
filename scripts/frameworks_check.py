"""Run the client libraries applications use against `veil proxy`, and print what works as a table.

A local fleet on loopback (SIMULATED attestation, the `dev` policy): one generation node, one embedding node
(`veil node --task embed --pooling mean`) and a tool node (below) behind one gateway, and `veil proxy` in front
of it, started as `veil proxy` is. Each library then makes its ordinary calls against the proxy's URL: its
default agent or tool loop, its structured-output helper, its embeddings call, and a request without
`max_tokens` that must run past 128 tokens. The table says, per library and feature, `works`, `refused` (a Veil
refusal, naming its field), or `fails` (another error), with the reason; it never shows a prompt or an answer.

A small story model writes no tool call of its own accord, so each tool loop is driven on its first turn only
(the table's notes say how): a regex constraint (`guided_regex`) that makes the model write a call in the
served template's Hermes format, which the node reads back under `tool_choice: "auto"`; or `tool_choice:
"required"` (forced by grammar). Where a library has no setting for one turn alone, `async_driving_client`, an httpx
transport, adds `tool_choice: "required"` to the first request of a conversation that has no tool result yet.
The loops forced by `tool_choice: "required"` (openai-agents, llama-index, pydantic-ai) run on a third node, a
random-weight `veil model init-tiny` model with a 2048-token context served as `veil-tools`: its forced answer may
hold up to 16 parallel calls, each replayed with its result, which outgrows stories260K's 512-token context.

The newest releases of these libraries cannot share one environment (instructor pins `jiter` below what the
newest `openai` needs), so each library runs in a virtual environment of its own, `VENVS/<library>/` (this
script runs itself there with `--run-checks LIBRARY --url URL`, which prints the outcomes as JSON), while the
fleet and the proxy run in the environment that holds Veil. `make frameworks` installs the newest releases
into `.venv-frameworks/` and runs this. Exit status: 0 when every check works or is not applicable, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

from pydantic import BaseModel, Field  # noqa: E402  (every library's environment has pydantic; only the fleet's has Veil)

CHAT_MODEL, EMBED_MODEL = "veil-chat", "veil-embed"
TOOL_MODEL = "veil-tools"  # the node of the loops forced by "required" (the docstring says why)
TOOL_PRESET, _TOOL_CONTEXT = "tiny", 2048  # the preset's max_position_embeddings
FEATURES = ("tool loop", "structured output", "embeddings", "no max_tokens, > 128 tokens")
LIBRARIES = {  # the name in the table: the distributions whose versions it ran
    "openai": ("openai",),
    "openai-agents": ("openai-agents",),
    "langchain-openai": ("langchain-openai", "langchain-core"),
    "instructor": ("instructor",),
    "litellm": ("litellm",),
    "llama-index": ("llama-index-core", "llama-index-llms-openai-like", "llama-index-embeddings-openai-like"),
    "pydantic-ai": ("pydantic-ai-slim",),
}
API_KEY = "unused-by-veil"
PROMPT = "Once upon a time, Lily wanted to know the weather in Paris."
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
UNCAPPED = {"ignore_eos": True}  # so that a story model's early end of text cannot end the answer before 128 tokens


class City(BaseModel):
    city: Literal["Paris", "Rome"]  # bounded, so that an answer forced to this shape always ends


class Words(BaseModel):
    words: list[Literal["once", "upon", "a", "time"]] = Field(min_length=100, max_length=100)


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@dataclass(frozen=True)
class Target:
    base_url: str  # the proxy's OpenAI base URL, ending in /v1


@dataclass
class Outcome:
    status: str  # works, refused, fails, n/a
    note: str


class NotApplicable(Exception):
    """The library has no such call."""


class Unexpected(Exception):
    """The call returned, but not what the feature promises; the message says what, never the text."""


# ----- driving a tool loop --------------------------------------------------------------------------


def _forced_first_turn(content: bytes, path: str) -> bytes | None:
    """The body with `tool_choice: "required"` when it offers tools and holds no tool result yet, else None."""
    if not path.endswith(("/chat/completions", "/responses")):
        return None
    body = json.loads(content)
    conversation = body.get("messages") or body.get("input") or []
    answered = isinstance(conversation, list) and any(
        isinstance(item, dict) and (item.get("role") == "tool" or item.get("type") == "function_call_output")
        for item in conversation)
    if not body.get("tools") or answered:
        return None
    body["tool_choice"] = "required"
    return json.dumps(body).encode()


def async_driving_client():
    """An `httpx.AsyncClient` whose transport forces the first turn of a tool loop (`_forced_first_turn`)."""
    try:
        import httpx
    except ImportError:  # the newest openai and pydantic-ai depend on httpx2, its successor, instead
        import httpx2 as httpx

    class AsyncFirstTurnDriver(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self._inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await request.aread()
            content = _forced_first_turn(request.content, request.url.path) if request.method == "POST" else None
            if content is not None:
                headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
                request = httpx.Request(request.method, request.url, headers=headers, content=content,
                                        extensions=request.extensions)
            return await self._inner.handle_async_request(request)

    return httpx.AsyncClient(transport=AsyncFirstTurnDriver(), timeout=300)


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise Unexpected(what)


def _tool_schema() -> dict:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


# ----- openai ---------------------------------------------------------------------------------------


def _openai(target: Target):
    import openai

    return openai.OpenAI(base_url=target.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def openai_tool_loop(target: Target) -> str:
    client = _openai(target)
    messages = [{"role": "user", "content": PROMPT}]
    first = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=[_tool_schema()],
                                           extra_body={"guided_regex": HERMES_CALL})
    [call] = first.choices[0].message.tool_calls or [None]
    _expect(call is not None and first.choices[0].finish_reason == "tool_calls", "no tool call came back")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": get_weather(**json.loads(call.function.arguments))}]
    second = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=[_tool_schema()])
    _expect(second.choices[0].finish_reason in ("stop", "length", "tool_calls"), "the second turn did not end")
    return "chat.completions with tools (auto); turn 1 driven by guided_regex writing a Hermes call"


def openai_structured(target: Target) -> str:
    parsed = _openai(target).chat.completions.parse(model=CHAT_MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                    response_format=City)
    _expect(isinstance(parsed.choices[0].message.parsed, City), "no parsed City")
    return "chat.completions.parse(response_format=Model)"


def openai_embeddings(target: Target) -> str:
    answer = _openai(target).embeddings.create(model=EMBED_MODEL, input=["a red boat", "a blue sky"])
    _expect(len(answer.data) == 2 and len(answer.data[0].embedding) > 0, "no vectors")
    return "embeddings.create (base64, decoded by the SDK)"


def openai_uncapped(target: Target) -> str:
    answer = _openai(target).chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                     extra_body=UNCAPPED)
    return _past_128(answer.usage.completion_tokens)


def _past_128(tokens: int) -> str:
    _expect(tokens > 128, f"stopped at {tokens} tokens")
    return f"{tokens} tokens (extra_body ignore_eos)"


# ----- openai-agents --------------------------------------------------------------------------------


def _agents_client(target: Target) -> None:
    import agents
    import openai

    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=target.base_url, api_key=API_KEY, max_retries=0,
                                                        timeout=300), use_for_tracing=False)
    agents.set_tracing_disabled(True)


def agents_tool_loop(target: Target) -> str:
    import agents

    _agents_client(target)
    called: list[str] = []

    @agents.function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        called.append(city)
        return get_weather(city)

    # A story answer cut by the context is `incomplete`, which the SDK raises: output_type makes the last turn end.
    agent = agents.Agent(name="weather", instructions="Answer about the weather.", model=TOOL_MODEL, tools=[weather],
                         model_settings=agents.ModelSettings(tool_choice="required"), output_type=City)
    result = agents.Runner.run_sync(agent, PROMPT, max_turns=4)
    _expect(bool(called) and isinstance(result.final_output, City), "the tool did not run before an answer")
    return (f"Agent + @function_tool on the Responses API; turn 1 tool_choice required ({len(called)} parallel "
            "calls, each run), reset to auto after the calls (the SDK's default); output_type=City so that the last "
            "turn ends")


def agents_structured(target: Target) -> str:
    import agents

    _agents_client(target)
    result = agents.Runner.run_sync(agents.Agent(name="city", model=CHAT_MODEL, output_type=City), PROMPT)
    _expect(isinstance(result.final_output, City), "no City")
    return "Agent(output_type=Model): text.format json_schema"


def agents_uncapped(target: Target) -> str:
    import agents

    _agents_client(target)
    # An answer the context cuts is `incomplete`, an error to the SDK: a schema of 100 words makes one that ends.
    result = agents.Runner.run_sync(agents.Agent(name="story", model=CHAT_MODEL, output_type=Words), PROMPT)
    tokens = result.context_wrapper.usage.output_tokens
    _expect(tokens > 128, f"stopped at {tokens} tokens")
    return f"{tokens} tokens (output_type: a list of 100 words, so that it ends before the context does)"


# ----- langchain-openai -----------------------------------------------------------------------------


def _chat_openai(target: Target, **fields):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=CHAT_MODEL, base_url=target.base_url, api_key=API_KEY, max_retries=0, timeout=300,
                      **fields)


def langchain_tool_loop(target: Target) -> str:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    bound = _chat_openai(target).bind_tools([weather])
    messages = [HumanMessage(PROMPT)]
    first = bound.invoke(messages, extra_body={"guided_regex": HERMES_CALL})
    _expect(len(first.tool_calls) == 1, "no tool call came back")
    messages += [first, ToolMessage(weather.invoke(first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])]
    second = bound.invoke(messages)
    _expect(isinstance(second.content, str), "no answer after the tool result")
    return "bind_tools (default tool choice) + ToolMessage; turn 1 driven by extra_body guided_regex (Hermes call)"


def langchain_structured(target: Target) -> str:
    answer = _chat_openai(target).with_structured_output(City).invoke(PROMPT)
    _expect(isinstance(answer, City), "no City")
    return "with_structured_output(Model) (default method)"


def langchain_embeddings(target: Target) -> str:
    from langchain_openai import OpenAIEmbeddings

    def embed(**fields) -> None:
        vectors = OpenAIEmbeddings(model=EMBED_MODEL, base_url=target.base_url, api_key=API_KEY, max_retries=0,
                                   **fields).embed_documents(["a red boat", "a blue sky"])
        _expect(len(vectors) == 2 and len(vectors[0]) > 0, "no vectors")

    try:
        embed()
        return "OpenAIEmbeddings().embed_documents (defaults)"
    except Exception as error:  # noqa: BLE001  (the default's failure is named; the documented setting is tried)
        default = _failure(error)
    # By default it tokenizes with tiktoken (fetching cl100k_base from the internet) and sends OpenAI's token ids.
    embed(check_embedding_ctx_length=False)
    return (f"with check_embedding_ctx_length=False (for non-OpenAI servers); the default {default.status}: "
            f"{default.note} (tiktoken: cl100k_base from the internet, then OpenAI's token ids)")


def langchain_uncapped(target: Target) -> str:
    answer = _chat_openai(target, extra_body=UNCAPPED).invoke(PROMPT)
    return _past_128(answer.usage_metadata["output_tokens"])


# ----- instructor -----------------------------------------------------------------------------------


def instructor_structured(target: Target) -> str:
    import instructor

    client = instructor.from_openai(_openai(target))
    city = client.chat.completions.create(model=CHAT_MODEL, response_model=City, max_retries=1,
                                          messages=[{"role": "user", "content": PROMPT}])
    _expect(isinstance(city, City), "no City")
    return "from_openai(...).chat.completions.create(response_model=Model), default mode (TOOLS)"


def instructor_uncapped(target: Target) -> str:
    import instructor

    client = instructor.from_openai(_openai(target))
    answer = client.chat.completions.create(model=CHAT_MODEL, response_model=None, extra_body=UNCAPPED,
                                            messages=[{"role": "user", "content": PROMPT}])
    return _past_128(answer.usage.completion_tokens)


def no_such_call(what: str) -> Callable[[Target], str]:
    def check(_: Target) -> str:
        raise NotApplicable(what)
    return check


# ----- litellm --------------------------------------------------------------------------------------


def _litellm_fields(target: Target) -> dict:
    return {"api_base": target.base_url, "api_key": API_KEY, "timeout": 300}


def litellm_tool_loop(target: Target) -> str:
    import litellm

    messages = [{"role": "user", "content": PROMPT}]
    first = litellm.completion(model=f"openai/{CHAT_MODEL}", messages=messages, tools=[_tool_schema()],
                               extra_body={"guided_regex": HERMES_CALL}, **_litellm_fields(target))
    calls = first.choices[0].message.tool_calls or []
    _expect(len(calls) == 1, "no tool call came back")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id,
                  "content": get_weather(**json.loads(calls[0].function.arguments))}]
    second = litellm.completion(model=f"openai/{CHAT_MODEL}", messages=messages, tools=[_tool_schema()],
                                **_litellm_fields(target))
    _expect(second.choices[0].finish_reason in ("stop", "length", "tool_calls"), "the second turn did not end")
    return "completion(tools) + tool message; turn 1 driven by extra_body guided_regex (Hermes call)"


def litellm_structured(target: Target) -> str:
    import litellm

    answer = litellm.completion(model=f"openai/{CHAT_MODEL}", messages=[{"role": "user", "content": PROMPT}],
                                response_format=City, **_litellm_fields(target))
    City.model_validate_json(answer.choices[0].message.content)
    return "completion(response_format=Model)"


def litellm_embeddings(target: Target) -> str:
    import litellm

    answer = litellm.embedding(model=f"openai/{EMBED_MODEL}", input=["a red boat", "a blue sky"],
                               **_litellm_fields(target))
    _expect(len(answer.data) == 2, "no vectors")
    return "litellm.embedding(model='openai/...')"


def litellm_uncapped(target: Target) -> str:
    import litellm

    answer = litellm.completion(model=f"openai/{CHAT_MODEL}", messages=[{"role": "user", "content": PROMPT}],
                                extra_body=UNCAPPED, **_litellm_fields(target))
    return _past_128(answer.usage.completion_tokens)


# ----- llama-index ----------------------------------------------------------------------------------


def _openai_like(target: Target, **fields):
    from llama_index.llms.openai_like import OpenAILike

    settings = {"model": CHAT_MODEL, "context_window": 512} | fields
    return OpenAILike(api_base=target.base_url, api_key=API_KEY, is_chat_model=True, is_function_calling_model=True,
                      max_retries=0, timeout=300, **settings)


def llamaindex_tool_loop(target: Target) -> str:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    called: list[str] = []

    def weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return get_weather(city)

    # llama-index cannot resolve a postponed Literal from the signature, so the schema is given: a random model's
    # free-text `city` runs on to the context's end.
    llm = _openai_like(target, model=TOOL_MODEL, context_window=_TOOL_CONTEXT, async_http_client=async_driving_client())
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=weather, fn_schema=City)], llm=llm)
    async def run_agent():
        return await agent.run(user_msg=PROMPT)  # the workflow needs a running loop when it starts

    answer = asyncio.run(run_agent())
    _expect(bool(called) and answer is not None, "the tool did not run before an answer")
    return (f"FunctionAgent + FunctionTool(fn_schema=City); turn 1 driven by FirstTurnDriver (tool_choice required: "
            f"{len(called)} parallel calls, each run)")


def llamaindex_structured(target: Target) -> str:
    from llama_index.core.prompts import PromptTemplate

    city = _openai_like(target).structured_predict(City, PromptTemplate("{story}"), story=PROMPT)
    _expect(isinstance(city, City), "no City")
    return "structured_predict(Model, prompt) (function-calling program)"


def llamaindex_embeddings(target: Target) -> str:
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embedder = OpenAILikeEmbedding(model_name=EMBED_MODEL, api_base=target.base_url, api_key=API_KEY, max_retries=0)
    vectors = embedder.get_text_embedding_batch(["a red boat", "a blue sky"])
    _expect(len(vectors) == 2 and len(vectors[0]) > 0, "no vectors")
    return "OpenAILikeEmbedding.get_text_embedding_batch"


def llamaindex_uncapped(target: Target) -> str:
    from llama_index.core.llms import ChatMessage

    answer = _openai_like(target, additional_kwargs={"extra_body": UNCAPPED}).chat([ChatMessage(role="user",
                                                                                                content=PROMPT)])
    return _past_128(answer.raw.usage.completion_tokens)


# ----- pydantic-ai ----------------------------------------------------------------------------------


def _pydantic_model(target: Target, http_client=None, name: str = CHAT_MODEL):
    """The model `Agent("openai:NAME")` makes, given a provider pointing at the proxy."""
    from pydantic_ai.models import infer_model
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=target.base_url, api_key=API_KEY, http_client=http_client)
    return infer_model(f"openai:{name}", provider_factory=lambda _: provider)


def pydantic_tool_loop(target: Target) -> str:
    from pydantic_ai import Agent

    called: list[str] = []
    model = _pydantic_model(target, async_driving_client(), TOOL_MODEL)
    agent = Agent(model)

    @agent.tool_plain
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        called.append(city)
        return get_weather(city)

    result = agent.run_sync(PROMPT)
    _expect(bool(called) and isinstance(result.output, str), "the tool did not run before an answer")
    return (f"Agent('openai:…') ({type(model).__name__}) + tool_plain; turn 1 driven by FirstTurnDriver "
            f"(tool_choice required: {len(called)} parallel calls, each run)")


def pydantic_structured(target: Target) -> str:
    from pydantic_ai import Agent

    result = Agent(_pydantic_model(target), output_type=City).run_sync(PROMPT)
    _expect(isinstance(result.output, City), "no City")
    return "Agent(output_type=Model) (default: an output tool)"


def pydantic_embeddings(target: Target) -> str:
    try:
        from pydantic_ai.embeddings import Embedder
        from pydantic_ai.embeddings.openai import OpenAIEmbeddingModel
    except ImportError as missing:
        raise NotApplicable("this release has no embeddings API") from missing
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=target.base_url, api_key=API_KEY)
    result = asyncio.run(Embedder(OpenAIEmbeddingModel(EMBED_MODEL, provider=provider)).embed_documents(
        ["a red boat", "a blue sky"]))
    _expect(len(result.embeddings) == 2, "no vectors")
    return "Embedder(OpenAIEmbeddingModel).embed_documents"


def pydantic_uncapped(target: Target) -> str:
    from pydantic_ai import Agent

    result = Agent(_pydantic_model(target), model_settings={"extra_body": UNCAPPED}).run_sync(PROMPT)
    usage = getattr(result.usage, "output_tokens", None) is None and result.usage() or result.usage
    return _past_128(usage.output_tokens)


CHECKS: dict[str, tuple[Callable[[Target], str], ...]] = {  # in FEATURES' order
    "openai": (openai_tool_loop, openai_structured, openai_embeddings, openai_uncapped),
    "openai-agents": (agents_tool_loop, agents_structured, no_such_call("the Agents SDK has no embeddings call"),
                      agents_uncapped),
    "langchain-openai": (langchain_tool_loop, langchain_structured, langchain_embeddings, langchain_uncapped),
    "instructor": (no_such_call("instructor has no agent or tool loop"), instructor_structured,
                   no_such_call("instructor has no embeddings call"), instructor_uncapped),
    "litellm": (litellm_tool_loop, litellm_structured, litellm_embeddings, litellm_uncapped),
    "llama-index": (llamaindex_tool_loop, llamaindex_structured, llamaindex_embeddings, llamaindex_uncapped),
    "pydantic-ai": (pydantic_tool_loop, pydantic_structured, pydantic_embeddings, pydantic_uncapped),
}


# ----- running and reporting ------------------------------------------------------------------------


def run_check(check: Callable[[Target], str], target: Target, show_tracebacks: bool) -> Outcome:
    try:
        return Outcome("works", check(target))
    except NotApplicable as reason:
        return Outcome("n/a", str(reason))
    except ImportError as error:
        return Outcome("fails", f"not installed: {error.name}")
    except Exception as error:  # noqa: BLE001  (every library raises its own kinds; the table names them)
        if show_tracebacks:
            traceback.print_exc()
        return _failure(error)


def _failure(error: BaseException) -> Outcome:
    """A Veil refusal found in the exception's chain (OpenAI's error shape: status, param, message), else the
    exception's class. Library messages are left out: a parse error may quote the model's answer."""
    seen: BaseException | None = error
    while seen is not None:
        body = getattr(seen, "body", None)
        if isinstance(body, dict) and "message" in body:
            return Outcome("refused", f"{getattr(seen, 'status_code', '')} param={body.get('param')}: "
                                      f"{body['message']}".strip())
        if isinstance(seen, Unexpected):
            return Outcome("fails", str(seen))
        seen = seen.__cause__ or seen.__context__
    return Outcome("fails", f"{type(error).__module__}.{type(error).__name__}")


def versions(library: str) -> str:
    found = []
    for distribution in LIBRARIES[library]:
        try:
            found.append(f"{distribution} {metadata.version(distribution)}")
        except metadata.PackageNotFoundError:
            found.append(f"{distribution} not installed")
    return ", ".join(found)


def run_checks(library: str, base_url: str, show_tracebacks: bool) -> dict:
    """This environment's library against the proxy: its versions and one outcome per feature."""
    outcomes = [run_check(check, Target(base_url), show_tracebacks) for check in CHECKS[library]]
    return {"versions": versions(library), "outcomes": [[o.status, o.note] for o in outcomes]}


def checks_in_venv(library: str, venvs: Path, base_url: str, show_tracebacks: bool, timeout_s: float) -> dict:
    """`run_checks` in the library's own environment, `venvs/<library>`."""
    python = venvs / library / "bin" / "python"
    if not python.is_file():
        return _all_failed(f"not installed: no {python} (`make frameworks` says why its install failed)")
    command = [str(python), str(Path(__file__).resolve()), "--run-checks", library, "--url", base_url]
    command += ["--traceback"] if show_tracebacks else []
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, timeout=timeout_s,
                              cwd=_REPO_ROOT)
    except subprocess.TimeoutExpired:
        return _all_failed(f"no answer in {timeout_s:g} s")
    if done.returncode != 0:
        return _all_failed(f"`{shlex.join(command[:2])} ...` exited with status {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _all_failed(reason: str) -> dict:
    return {"versions": "?", "outcomes": [["fails", reason]] * len(FEATURES)}


def table(results: dict[str, dict]) -> str:
    lines = ["| library (version) | " + " | ".join(FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    for library, result in results.items():
        cells = [f"{status}: {note}".replace("|", "/") for status, note in result["outcomes"]]
        lines.append(f"| {library} ({result['versions']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----- the fleet and the proxy ----------------------------------------------------------------------


def start_proxy(gateway_url: str, env: dict[str, str], deadline_s: float) -> tuple[subprocess.Popen, str]:
    """`veil proxy` as a user runs it, on a free loopback port; its banner names the URL."""
    proxy = subprocess.Popen([sys.executable, "-m", "veil", "proxy", "--listen", "127.0.0.1:0", "--gateway",
                              gateway_url, "--policy", "dev"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=_REPO_ROOT)
    deadline = time.monotonic() + deadline_s
    for line in proxy.stderr:
        found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        if found:
            return proxy, found.group(1)
        if time.monotonic() > deadline:
            break
    proxy.kill()
    raise SystemExit("veil proxy did not start")


def run(args: argparse.Namespace) -> int:
    from engine.tiny import write_tiny_model
    from veil.fleet import Fleet, FleetSettings

    workdir = Path(args.workdir).resolve() if args.workdir else None
    common = {"nodes": 1, "model_dir": args.model, "torch_threads": 1}
    embed_settings = FleetSettings(**common, model_names=(EMBED_MODEL,), workdir=workdir and workdir / "embed",
                                   extra_node_args=("--task", "embed", "--pooling", "mean"))
    with Fleet(embed_settings) as embedding, tempfile.TemporaryDirectory() as scratch:
        tool_model = write_tiny_model(Path(scratch) / "tools", TOOL_PRESET)
        tool_settings = FleetSettings(**{**common, "model_dir": tool_model}, sim_root_dir=embedding.sim_root_dir,
                                      model_names=(TOOL_MODEL,), workdir=workdir and workdir / "tools")
        with Fleet(tool_settings) as tools:
            extra = tuple(f"127.0.0.1:{fleet.nodes[0].port}" for fleet in (embedding, tools))
            chat_settings = FleetSettings(**common, sim_root_dir=embedding.sim_root_dir, model_names=(CHAT_MODEL,),
                                          workdir=workdir and workdir / "chat", extra_gateway_nodes=extra)
            results = _run_behind_proxy(chat_settings, args)
    print(table(results))
    return 0 if all(status in ("works", "n/a") for r in results.values() for status, _ in r["outcomes"]) else 1


def _run_behind_proxy(chat_settings, args: argparse.Namespace) -> dict[str, dict]:
    """The chat fleet, whose gateway also admits the embedding and tool nodes, `veil proxy`, and the checks."""
    from attestation.sim_root import ROOT_DIR_ENV
    from veil.fleet import Fleet

    with Fleet(chat_settings) as fleet:
        fleet.wait_for_pool(3, timeout_s=120)
        proxy, base_url = start_proxy(fleet.gateway_url, {**os.environ, ROOT_DIR_ENV: str(fleet.sim_root_dir)},
                                      deadline_s=120)
        try:
            return {library: checks_in_venv(library, args.venvs, base_url, args.traceback, args.timeout_s)
                    for library in CHECKS if not args.only or library in args.only}
        finally:
            proxy.terminate()
            proxy.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="`make frameworks` installs the libraries and runs this.")
    parser.add_argument("--model", type=Path, default=None,
                        help="the model folder the chat and embedding nodes serve (default: the shipped stories260K); "
                             "the forced tool loops' node serves `veil model init-tiny`")
    parser.add_argument("--venvs", type=Path, default=_REPO_ROOT / ".venv-frameworks",
                        help="the folder holding one virtual environment per library, named as the table names it "
                             "(default: .venv-frameworks)")
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="check only this library (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=1200.0,
                        help="how long one library's checks may take (default: 1200)")
    parser.add_argument("--workdir", default=None,
                        help="keep the fleet's logs and audit files here (default: a temporary folder, removed)")
    parser.add_argument("--traceback", action="store_true",
                        help="print each failure's traceback to stderr (it may quote this script's synthetic prompts "
                             "and the model's answers)")
    parser.add_argument("--run-checks", choices=sorted(CHECKS), help=argparse.SUPPRESS)  # inside a library's venv
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_checks:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import
        print(json.dumps(run_checks(args.run_checks, args.url, args.traceback)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
