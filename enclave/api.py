"""The OpenAI-style API that runs inside the encryption: chat and text completions, model listing.

Handlers turn a decrypted Binary HTTP request into an `InnerResponse`: a JSON body, or a stream of
server-sent events with one event per engine delta. Error bodies name what was wrong, never what
the request said. The parts: `replay_window` (the Date check), `request_fields` (the body read into
chat messages and `SamplingParams`), `openai_shapes` (what goes back), this module (routing and
the engine).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine import EngineCoreClient, EngineError, PoolingKind, RequestOutput, RequestRejected, SamplingParams, StreamDelta, Tokenizer
from enclave import answer_parts, embeddings, request_fields, responses_answer, responses_request, template_fields, tool_fields
from enclave.api_types import ApiError, InnerResponse, error_response
from enclave.openai_shapes import ResponseShape
from enclave.replay_window import REQUEST_DATE_WINDOW_S, DateOutOfWindow, check_date
from enclave.tool_calls import markers as tool_markers, tool_format
from ohttp.bhttp import Request
from ohttp.dates import format_http_date
from protocol.constants import MAX_INNER_BODY_BYTES, TASK_EMBED, TASK_GENERATE

__all__ = ["REQUEST_DATE_WINDOW_S", "ApiError", "InnerApi", "InnerResponse", "error_response"]


@dataclass(slots=True)
class InnerApi:
    engine: EngineCoreClient
    tokenizer: Tokenizer
    model_name: str  # the id answers name; `aliases`: other ids it is asked for by (`--model-name` given again)
    aliases: tuple[str, ...] = ()
    tool_call_format: str | None = None  # the operator's named format (`--tool-call-format`); None: the template's
    date_window_s: float = REQUEST_DATE_WINDOW_S
    clock: Callable[[], float] = time.time
    created: int = field(default_factory=lambda: int(time.time()))  # OpenAI's `created`: when the node began serving
    pooling: PoolingKind | None = None  # an embedding model's pooling (`veil node --task embed`); None: generation

    @property
    def max_tokens_limit(self) -> int:
        return self.engine.max_model_len

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)

    @property
    def task(self) -> str:
        """What every one of `model_names` serves: "generate" or "embed" (`protocol.constants.MODEL_TASKS`)."""
        return TASK_GENERATE if self.pooling is None else TASK_EMBED

    def handle(self, request: Request) -> InnerResponse:
        try:
            check_date(request, self.clock(), self.date_window_s)
            return self._route(request)
        except DateOutOfWindow as error:
            response = error_response(error)
            # The node's own time, so that a client can tell how far off its clock is.
            response.headers.append((b"date", format_http_date(self.clock())))
            return response
        except ApiError as error:
            return error_response(error)
        except RequestRejected as error:
            return error_response(_rejection(error, _PROMPT_FIELDS.get(request.path.split(b"?", 1)[0])))
        except EngineError:
            return error_response(ApiError(500, "engine_error", "the engine failed this request"))
        except Exception:  # noqa: BLE001 - an unforeseen bug answers inside the encryption, saying nothing
            return error_response(ApiError(500, "engine_error", "the node failed this request"))

    def _route(self, request: Request) -> InnerResponse:
        path = request.path.split(b"?", 1)[0]
        routes = {
            b"/v1/models": (b"GET", self._models),
            b"/v1/chat/completions": (b"POST", self._chat),
            b"/v1/completions": (b"POST", self._completions),
            b"/v1/responses": (b"POST", self._responses),
            b"/v1/embeddings": (b"POST", self._embeddings),
        }
        if path.startswith(b"/v1/responses/"):
            raise ApiError(404, "not_found", f"responses are never stored ({responses_request.NO_STATE}), so there "
                           "is none to retrieve, cancel or delete by id")
        if path not in routes:
            raise ApiError(404, "not_found", "no such endpoint; use /v1/chat/completions, /v1/completions, "
                           "/v1/responses, /v1/embeddings or /v1/models")
        method, handler = routes[path]
        if request.method.upper() != method:
            raise ApiError(405, "method_not_allowed", f"use {method.decode()} for this endpoint")
        if self.pooling is not None and path in _GENERATION_PATHS:
            raise embeddings.not_a_generation_model(self.model_name)
        return handler(request)

    def _models(self, request: Request) -> InnerResponse:
        task = {"task": self.task} | ({} if self.pooling is None else {"pooling": self.pooling.value})
        models = [{"id": name, "object": "model", "created": self.created, "owned_by": "veil"} | task
                  for name in self.model_names]
        body = {"object": "list", "data": models}
        return InnerResponse(200, json.dumps(body).encode())

    def _embeddings(self, request: Request) -> InnerResponse:
        """OpenAI's embeddings (`enclave.embeddings`): an embedding node's pooled final states."""
        body = self._json_body(request)
        if self.pooling is None:
            raise embeddings.not_an_embedding_model(self.model_name)
        call = embeddings.read_call(body, self.pooling)
        outputs = embeddings.embed(call, self.engine, self.tokenizer)
        body = embeddings.answer(outputs, call, self.model_name)
        return InnerResponse(200, json.dumps(body).encode(), metrics=embeddings.call_metrics(outputs))

    def _chat(self, request: Request) -> InnerResponse:
        return self._chat_answer(self._json_body(request))

    def _responses(self, request: Request) -> InnerResponse:
        """OpenAI's Responses API, served as the chat completion it describes (`responses_request`)."""
        body = self._json_body(request)
        call = responses_request.translate(body)
        try:
            answer = self._chat_answer(call.chat)
        except RequestRejected as error:
            raise responses_request.renamed(_rejection(error, "messages")) from None
        except ApiError as error:
            raise responses_request.renamed(error) from None
        ident = responses_answer.response_id()
        if answer.streaming:
            builder = responses_answer.ResponseBuilder(call, ident, self.model_name, int(time.time()))
            answer.events = responses_answer.events(answer.events, responses_answer.ResponseStream(builder))
        else:
            answer.body = json.dumps(responses_answer.whole(json.loads(answer.body), call, ident)).encode()
        return answer

    def _chat_answer(self, body: dict) -> InnerResponse:
        tools = tool_fields.tool_request(body)
        messages = request_fields.messages(body.get("messages"))
        template = self.tokenizer.chat_template(with_tools=tools.tools is not None)
        kwargs = template_fields.template_kwargs(body, template)
        prompt = self.tokenizer.encode_chat(messages, tools=tools.tools, template_kwargs=kwargs)
        reasoning = answer_parts.reasons(template)
        # Whether the template's generation prompt opened or closed the block: read from its last few tokens.
        tail = self._prompt_text(prompt[-answer_parts.TAIL_TOKENS:])
        place = answer_parts.reasoning_place(tail) if reasoning else "none"
        return self._generate(body, prompt, chat=True, tools=tools, reasoning=(reasoning, place))

    def _completions(self, request: Request) -> InnerResponse:
        body = self._json_body(request)
        prompt = request_fields.prompt(body)
        echo = self._prompt_text(prompt) if request_fields.echo(body) else ""
        if isinstance(prompt, str) and prompt:  # encoded here: a control token the text spells stays text
            prompt = self.tokenizer.encode_prompt(prompt)
        return self._generate(body, prompt, chat=False, echo=echo)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """The text `echo` puts before each completion: the prompt as given, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        if not all(0 <= token < self.tokenizer.vocab_size for token in prompt):
            raise ApiError(400, "invalid_token", "the prompt contains token ids outside the model's vocabulary",
                           param="prompt")
        return self.tokenizer.decode(prompt, skip_special_tokens=False)

    def _json_body(self, request: Request) -> dict:
        if len(request.content) > MAX_INNER_BODY_BYTES:
            raise ApiError(413, "too_large", f"the request body exceeds {MAX_INNER_BODY_BYTES} bytes")
        try:
            body = json.loads(request.content)
        except (ValueError, RecursionError):  # also nesting too deep, integers too long, bad UTF-8
            raise ApiError(400, "invalid_json", "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request", "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "invalid_request", "'model' must be a string", param="model")
        if model is not None and model not in self.model_names:
            raise ApiError(404, "model_not_found", "this node does not serve the requested model; see /v1/models",
                           param="model")
        return body

    def _generate(self, body: dict, prompt: str | list[int], chat: bool, echo: str = "",
                  tools: tool_fields.ToolRequest | None = None,
                  reasoning: tuple[bool, str] = (False, "none")) -> InnerResponse:
        """`reasoning`: whether the model reasons in `<think>` blocks, and where the prompt left one
        (`answer_parts.reasoning_place`): a constraint then applies after the reasoning."""
        tools = tools or tool_fields.ToolRequest()
        template = self.tokenizer.chat_template(with_tools=True)
        call_format = tools.call_format(template, self.tool_call_format)
        special = {text: token for text in tool_markers(call_format) for token in self.tokenizer.special_ids_of((text,))}
        params = _with_tool_grammar(request_fields.sampling_params(body, chat, self.max_tokens_limit), tools,
                                    call_format, special)
        params = self._keeping_markers(answer_parts.reasoning_first(params, reasoning[1]), call_format, reasoning[0])
        handle = self.engine.submit(prompt, params)
        completion_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        shape = ResponseShape(completion_id, self.model_name, chat, int(time.time()),
                              logprobs=params.logprobs is not None, token_text=self._token_text, echo=echo,
                              tool_format=call_format, parallel_tool_calls=tools.parallel,
                              tool_call_ids=self.tool_call_format or tool_format(template),
                              tool_names=tools.names,
                              reasoning=reasoning[0], reasoning_opened=reasoning[1] == "inside")
        include_usage = request_fields.include_usage(body)
        if body.get("stream") is True:
            batches = handle.delta_batches()
            first = _first_batch(batches, handle)  # surfaces a refusal as an HTTP error, not a broken stream
            response = InnerResponse(200, on_close=[handle.close])
            response.events = shape.events(first, batches, handle, response, include_usage)
            return response
        try:
            output = RequestOutput(handle.request_id, [])
            for delta in handle.deltas():
                output.add(delta)
        finally:
            handle.close()
        return InnerResponse(200, json.dumps(shape.whole(output)).encode(), metrics=output.metrics)

    def _keeping_markers(self, params: SamplingParams, call_format: str | None, reasoning: bool) -> SamplingParams:
        """The special tokens the answer's parsers read by kept in its text (`[TOOL_CALLS]`, `<|python_tag|>`,
        `<think>` where special); every other one, end of turn included, stays out of it."""
        texts = tool_markers(call_format) + ((answer_parts.THINK_OPEN, answer_parts.THINK_CLOSE) if reasoning else ())
        kept = self.tokenizer.special_ids_of(texts)
        return dataclasses.replace(params, kept_special_tokens=kept) if kept else params

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# The fields an engine refusal can name: its messages begin with the field's name.
_SAMPLING_NAMES = frozenset({"max_tokens", "temperature", "top_k", "top_p", "min_p", "n", "seed", "stop",
                             "stop_token_ids", "logprobs", "tool_choice", "tools", "messages", "logit_bias", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "response_format", "structured_outputs",
                             "guided_json", "guided_regex", "guided_choice", "guided_grammar"})


def _with_tool_grammar(params: SamplingParams, tools: tool_fields.ToolRequest, call_format: str | None,
                       special: dict[str, int]) -> SamplingParams:
    """A forced tool choice constrains the answer as a structured output does: one constraint per answer.
    OpenAI's `response_format` (`text.format`) shapes message text, which a forced call has none of, so it
    gives way, as OpenAI's does; vLLM's own constraints (`structured_outputs`, `guided_*`) are on the whole
    output, and are refused beside a forced choice. Under "auto" the response format shapes the answer only
    where it calls no tool: the answer is calls in the model's `call_format` or text in the format."""
    grammar = tools.grammar()
    answer = params.structured
    if grammar is None and tools.choice == "auto" and answer is not None and answer.field.startswith("response_format"):
        return dataclasses.replace(params, structured=tools.beside(answer, call_format, special))
    if grammar is None:
        return params
    if params.structured is not None and not params.structured.field.startswith("response_format"):
        raise ApiError(400, "unsupported_parameter", "a forced 'tool_choice' cannot be combined with another "
                       "constraint on the whole answer (structured_outputs, guided_*)", param="tool_choice")
    return dataclasses.replace(params, structured=grammar)


# The endpoints an embedding node refuses: its model generates nothing.
_GENERATION_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"})

# The field a refusal of the whole prompt (too long for the context) names, by endpoint.
_PROMPT_FIELDS = {b"/v1/chat/completions": "messages", b"/v1/completions": "prompt", b"/v1/responses": "input",
                  b"/v1/embeddings": "input"}


def _rejection(error: RequestRejected, prompt_field: str | None) -> ApiError:
    """An engine refusal in OpenAI's shape, naming the field it is about where its words say."""
    param = _param_of(str(error)) or (prompt_field if error.reason == "prompt_too_long" else None)
    return ApiError(400, error.reason, str(error), param=param)


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0].split(".", 1)[0]  # a constraint's refusal names its path: response_format.x
    if first in _SAMPLING_NAMES:
        return first
    return "stop" if "stop strings" in message else None


def _first_batch(batches: Iterator[list[StreamDelta]], handle) -> list[StreamDelta]:
    try:
        return next(batches, [])
    except RequestRejected:
        handle.close()
        raise


