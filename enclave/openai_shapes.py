"""OpenAI's response shapes for one completion: whole answers, streamed chunks, usage, logprobs."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from enclave.api_types import InnerResponse
from enclave.answer_parts import ChoiceReader, ReasoningParser
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
    tool_call_ids: str | None = None  # the template's tool-call format, whose id form calls take (forced calls too)
    tool_names: frozenset[str] | None = None  # the functions the request declares: the only ones a call may name
    reasoning: bool = False  # chat: the model reasons in `<think>` blocks, returned as `reasoning_content`
    reasoning_opened: bool = False  # the prompt ends inside such a block: the answer starts as reasoning

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
            reader = self._reader()
            if reader is not None:
                reasoning, parsed = reader.read(text, last=True)
                tool_calls = [call.openai() for call in parsed.calls]
                message["content"] = (parsed.content or None) if tool_calls or reasoning else parsed.content
                if self.reasoning:
                    message["reasoning_content"] = reasoning or None
                if tool_calls:
                    message["tool_calls"] = tool_calls
                finish_reason = reader.finish_reason(finish_reason)
            return {"index": index, "message": message,
                    "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {"index": index, "text": self.echo + text, "finish_reason": finish_reason,
                "logprobs": self._logprobs(logprobs)}

    def _reader(self) -> ChoiceReader | None:
        """A choice's reader of reasoning and tool calls; None where its text is only content."""
        if not self.chat or (self.tool_format is None and not self.reasoning):
            return None
        calls = None if self.tool_format is None else ChoiceCalls(self.tool_format, self.parallel_tool_calls,
                                                                  self.tool_call_ids, self.tool_names)
        return ChoiceReader(ReasoningParser(self.reasoning_opened) if self.reasoning else None, calls)

    def chunk(self, delta: StreamDelta, first_of_choice: bool) -> dict:
        """One streamed delta, as it is: its text is all content."""
        finish = _reason(delta.finish_reason)
        logprobs = self._logprobs(list(delta.logprobs))
        if self.chat:
            content = {"role": "assistant", "content": delta.text} if first_of_choice else {"content": delta.text}
            choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
        else:
            text = self.echo + delta.text if first_of_choice else delta.text
            choice = {"index": delta.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return self._wrap(choice)

    def read_chunks(self, delta: StreamDelta, first_of_choice: bool, reader: ChoiceReader) -> list[dict]:
        """One streamed delta read for reasoning and tool calls, as OpenAI streams them: text first, then
        one chunk per piece of a call (the first names it), and a call's answer ends on an empty delta that
        carries `finish_reason` alone (the SDK's stream helper closes a call's arguments only there). A delta
        that settles nothing yet (its text is held) sends nothing."""
        reasoning, parsed = reader.read(delta.text, last=delta.finish_reason is not None)
        finish = reader.finish_reason(_reason(delta.finish_reason))
        logprobs = self._logprobs(list(delta.logprobs))
        separate_finish = finish is not None and reader.called
        head: dict = {"role": "assistant"} if first_of_choice else {}
        if reasoning:
            head["reasoning_content"] = reasoning
        if parsed.content or not (reasoning or parsed.pieces or separate_finish):
            head["content"] = parsed.content
        chunks = []
        if first_of_choice or reasoning or parsed.content or delta.logprobs or (finish and not separate_finish):
            chunks.append(self._delta(delta.index, head, logprobs, None if separate_finish else finish))
        chunks += [self._delta(delta.index, {"tool_calls": [piece.fragment()]}) for piece in parsed.pieces]
        if separate_finish:
            chunks.append(self._delta(delta.index, {}, None, finish))
        return chunks

    def _delta(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        return self._wrap({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def _wrap(self, choice: dict) -> dict:
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
        started: dict[int, ChoiceReader | None] = {}
        try:
            for batch in itertools.chain([first], rest):
                for delta in batch:
                    response.metrics = delta.metrics or response.metrics
                events = b"".join(self._event(delta, started) for delta in batch)
                if events:  # a batch whose text is all held back (a call being written) sends nothing yet
                    yield events
            if include_usage:
                yield b"data: " + json.dumps(self.usage_chunk(response.metrics)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            handle.close()

    def _event(self, delta: StreamDelta, started: dict[int, ChoiceReader | None]) -> bytes:
        first_of_choice = delta.index not in started
        if first_of_choice:
            started[delta.index] = self._reader()
        reader = started[delta.index]
        chunks = [self.chunk(delta, first_of_choice)] if reader is None else self.read_chunks(delta, first_of_choice, reader)
        return b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)

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
