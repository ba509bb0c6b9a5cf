"""OpenAI's response shapes for one completion: whole answers, streamed chunks, usage, logprobs."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from enclave.api_types import InnerResponse
from enclave.tool_calls import ChoiceCalls


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """OpenAI response shapes for one completion."""

    completion_id: str
    model: str
    chat: bool
    created: int
    logprobs: bool = False  # whether the request asked for them
    token_text: Callable[[int], str] = str
    echo: str = ""  # completions' `echo`: the prompt's text, put before each choice's text
    tool_format: str | None = None  # chat: the format tool calls are read from (`tool_calls`); None: not read
    parallel_tool_calls: bool = True

    def whole(self, output: RequestOutput) -> dict:
        choices = [self._choice(o.index, o.text, _reason(o.finish_reason), o.logprobs) for o in output.outputs]
        return {
            "id": self.completion_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(output.metrics),
        }

    def usage_chunk(self, metrics: RequestMetrics | None) -> dict:
        """The last chunk OpenAI streams when asked to include usage: no choices, the whole request's usage."""
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(metrics),
        }

    def _choice(self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob]) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if self.tool_format is not None:
                calls = self._calls()
                parsed = calls.read(text, last=True)
                tool_calls = [call.openai() for call in parsed.calls]
                message["content"] = (parsed.content or None) if tool_calls else parsed.content
                if tool_calls:
                    message["tool_calls"] = tool_calls
                finish_reason = calls.finish_reason(finish_reason)
            return {"index": index, "message": message,
                    "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {"index": index, "text": self.echo + text, "finish_reason": finish_reason,
                "logprobs": self._logprobs(logprobs)}

    def _calls(self) -> ChoiceCalls:
        return ChoiceCalls(self.tool_format, self.parallel_tool_calls)

    def chunk(self, delta: StreamDelta, first_of_choice: bool, calls: ChoiceCalls | None = None) -> dict:
        """One streamed delta; with `calls` (the choice's tool calls so far), its text is read for calls."""
        finish = _reason(delta.finish_reason)
        logprobs = self._logprobs(list(delta.logprobs))
        if self.chat:
            content = {"role": "assistant", "content": delta.text} if first_of_choice else {"content": delta.text}
            if calls is not None:
                parsed = calls.read(delta.text, last=delta.finish_reason is not None)
                content["content"] = parsed.content
                if parsed.pieces:
                    content["tool_calls"] = [piece.fragment() for piece in parsed.pieces]
                finish = calls.finish_reason(finish)
            choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
        else:
            text = self.echo + delta.text if first_of_choice else delta.text
            choice = {"index": delta.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def events(
        self, first: list[StreamDelta], rest: Iterator[list[StreamDelta]], handle, response: InnerResponse,
        include_usage: bool = False,
    ) -> Iterator[bytes]:
        """Server-sent events, one piece per batch of deltas (one event per delta within it)."""
        started: dict[int, ChoiceCalls | None] = {}
        try:
            for batch in itertools.chain([first], rest):
                for delta in batch:
                    response.metrics = delta.metrics or response.metrics
                if batch:
                    yield b"".join(self._event(delta, started) for delta in batch)
            if include_usage:
                yield b"data: " + json.dumps(self.usage_chunk(response.metrics)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            handle.close()

    def _event(self, delta: StreamDelta, started: dict[int, ChoiceCalls | None]) -> bytes:
        first_of_choice = delta.index not in started
        if first_of_choice:
            started[delta.index] = self._calls() if self.chat and self.tool_format is not None else None
        chunk = self.chunk(delta, first_of_choice, started[delta.index])
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"


    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """OpenAI's shapes: chat lists one object per token; text completions keep parallel lists."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [dict(self._token(e.token_id, e.logprob),
                                     top_logprobs=[self._token(t, lp) for t, lp in e.top]) for e in entries]}
        return {
            "tokens": [self.token_text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        # A token holding part of a character has no text of its own; OpenAI then gives no bytes either.
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        return {"token": text, "logprob": logprob, "bytes": raw}


def _usage(metrics: RequestMetrics | None) -> dict:
    prompt_tokens = metrics.prompt_tokens if metrics else 0
    completion_tokens = metrics.output_tokens if metrics else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _reason(reason) -> str | None:
    return None if reason is None else reason.value
