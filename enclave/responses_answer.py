"""A chat completion's answer in the shapes of OpenAI's Responses API: the Response object, and its events.

The node serves `/v1/responses` as a chat completion (`responses_request`); this module maps the answer
back. A whole answer becomes one Response: the assistant's text as a `message` item, each tool call as
a `function_call` item. A stream becomes the Responses event stream: `response.created` and
`response.in_progress`, then for each item `response.output_item.added`, its text deltas
(`response.output_text.delta`) or argument deltas (`response.function_call_arguments.delta`), their
`.done` events and `response.output_item.done`, and at the end `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the answer) carrying the whole Response with its usage.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from enclave.responses_request import ResponsesCall


def response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def whole(chat: dict, call: ResponsesCall, ident: str) -> dict:
    """The Response for a whole chat completion."""
    choice = chat["choices"][0]
    message = choice["message"]
    builder = ResponseBuilder(call, ident, chat["model"], chat["created"])
    if message.get("content"):
        builder.items.append(_message_item(message["content"], "completed"))
    for tool_call in message.get("tool_calls") or []:
        function = tool_call["function"]
        builder.items.append(_call_item(tool_call["id"], function["name"], function["arguments"], "completed"))
    return builder.response(_status(choice["finish_reason"]), chat.get("usage"))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(text: str, status: str) -> dict:
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass(slots=True)
class ResponseBuilder:
    """One Response being made: its output items so far, and the object that states it."""

    call: ResponsesCall
    ident: str
    model: str
    created: int
    items: list[dict] = field(default_factory=list)

    def response(self, status: str, usage: dict | None = None) -> dict:
        ended = status in ("completed", "incomplete")
        return {
            "id": self.ident, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": [dict(item) for item in self.items],
            "usage": _usage(usage) if ended else None,
            **self.call.echo,
        }


def _usage(chat_usage: dict | None) -> dict:
    chat_usage = chat_usage or {}
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


# ----- the event stream ---------------------------------------------------------------------------

@dataclass(slots=True)
class ResponseStream:
    """Turns a chat completion's chunks into the Responses events, item by item."""

    builder: ResponseBuilder
    sequence: int = 0
    open_text: int | None = None  # the output index of the message item being written
    calls: dict[int, int] = field(default_factory=dict)  # chat's tool-call index -> its output index
    open_calls: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None

    def start(self) -> bytes:
        response = self.builder.response("in_progress")
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)

    def chunk(self, chunk: dict) -> bytes:
        """The events for one chat chunk (its text, its tool-call pieces, its usage)."""
        self.usage = chunk.get("usage") or self.usage
        out = b""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for piece in delta.get("tool_calls") or []:
                out += self._call_piece(piece)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def end(self) -> bytes:
        out = self._close_text()
        for index in self.open_calls:
            out += self._close_call(index)
        self.open_calls = []
        status = _status(self.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self.builder.response(status, self.usage))

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open_text is None:
            self.open_text = len(self.builder.items)
            item = _message_item("", "in_progress")
            item["content"] = []
            self.builder.items.append(item)
            out += self._event("response.output_item.added", output_index=self.open_text, item=dict(item))
            item["content"] = [_text_part("")]
            out += self._event("response.content_part.added", item_id=item["id"], output_index=self.open_text,
                               content_index=0, part=_text_part(""))
        item = self.builder.items[self.open_text]
        item["content"][0]["text"] += text
        return out + self._event("response.output_text.delta", item_id=item["id"], output_index=self.open_text,
                                 content_index=0, delta=text, logprobs=[])

    def _close_text(self) -> bytes:
        if self.open_text is None:
            return b""
        index, self.open_text = self.open_text, None
        item = self.builder.items[index]
        item["status"] = "completed"
        part = item["content"][0]
        return (self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[])
                + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(part))
                + self._event("response.output_item.done", output_index=index, item=_copy(item)))

    def _call_piece(self, piece: dict) -> bytes:
        out = b""
        function = piece.get("function") or {}
        if piece.get("index") not in self.calls:
            out += self._close_text()  # a call follows the text before it, as its own item
            index = len(self.builder.items)
            self.calls[piece.get("index")] = index
            self.open_calls.append(index)
            item = _call_item(piece.get("id") or "call_" + secrets.token_hex(12), function.get("name") or "", "",
                              "in_progress")
            self.builder.items.append(item)
            out += self._event("response.output_item.added", output_index=index, item=dict(item))
        index = self.calls[piece.get("index")]
        item = self.builder.items[index]
        arguments = function.get("arguments") or ""
        if not arguments:
            return out
        item["arguments"] += arguments
        return out + self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=arguments)

    def _close_call(self, index: int) -> bytes:
        item = self.builder.items[index]
        item["status"] = "completed"
        return (self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
                + self._event("response.output_item.done", output_index=index, item=dict(item)))

    def _event(self, kind: str, **fields: object) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def events(chat_events: Iterator[bytes], stream: ResponseStream) -> Iterator[bytes]:
    """The Responses events for a chat stream's server-sent events (this node's own, one `data:` each)."""
    try:
        yield stream.start()
        for batch in chat_events:
            out = b""
            for event in batch.split(b"\n\n"):
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    out += stream.end() + b"data: [DONE]\n\n"  # the end Veil's client checks for truncation
                elif data:
                    out += stream.chunk(json.loads(data))
            if out:
                yield out
    finally:
        close = getattr(chat_events, "close", None)
        if close is not None:
            close()  # the chat stream closes its engine request
