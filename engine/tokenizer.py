"""Tokenizer and chat template of a Hugging Face model folder."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models

from engine.chat_template import ChatMessage, ChatTemplates, ToolCall
from engine.errors import ModelLoadError, RequestRejected

__all__ = ["ChatMessage", "Tokenizer", "ToolCall"]


class Tokenizer:
    """Wraps `tokenizer.json` (through the `tokenizers` library) and the chat template."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in model folder {folder}")
        self._tokenizer = FastTokenizer.from_file(str(path))
        _turn_off_word_cache(self._tokenizer)
        self.templates = ChatTemplates.load(folder, _read_settings(folder))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, ValueError):  # e.g. lone surrogates: not text the tokenizer can read
            raise RequestRejected("invalid_text", "the text is not valid Unicode") from None
        finally:
            _forget_words(self._tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decoder(self) -> Callable[[list[int]], str]:
        """`decode` as one call into the library, without this wrapper's frame (per sample per step)."""
        return functools.partial(self._tokenizer.decode, skip_special_tokens=True)

    def token_texts(self, vocab_size: int) -> list[str]:
        """`decode([t])` of every id below `vocab_size`: the vocabulary's own, nothing of any request."""
        return self._tokenizer.decode_batch([[t] for t in range(vocab_size)], skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text: what llguidance indexes the vocabulary from."""
        return self._tokenizer.to_str()

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def chat_template(self, with_tools: bool = False) -> str | None:
        """The template text a chat renders with: what the tool-call format is read from."""
        return self.templates.source(with_tools)

    def apply_chat_template(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The conversation as the model's template writes it; `tools` as OpenAI's function tools (JSON schemas)."""
        return self.templates.render(messages, tools, add_generation_prompt)

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
        # Templates write the BOS token themselves, so special tokens are not added a second time.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


# Models whose word cache maps the words of past texts to their tokens for the life of the process.
_CACHING_MODELS = (models.BPE, models.Unigram)


def _turn_off_word_cache(tokenizer: FastTokenizer) -> None:
    """A prompt's words must not outlive its request in the tokenizer's memory."""
    model = tokenizer.model
    if not isinstance(model, _CACHING_MODELS):
        return
    if not hasattr(model, "_resize_cache"):
        raise ModelLoadError("this tokenizers version cannot turn off its word cache; install tokenizers >= 0.21")
    model._resize_cache(0)


def _forget_words(tokenizer: FastTokenizer) -> None:
    # Also after every encode: a library version may keep a few words even at capacity zero.
    model = tokenizer.model
    if isinstance(model, _CACHING_MODELS):
        model._clear_cache()


def _read_settings(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"tokenizer_config.json in {folder} is not valid JSON") from None
    if not isinstance(settings, dict):
        raise ModelLoadError(f"tokenizer_config.json in {folder} is not a JSON object")
    return settings
