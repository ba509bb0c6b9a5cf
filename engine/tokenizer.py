"""Tokenizer and chat template of a Hugging Face model folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models

from engine.errors import ModelLoadError, RequestRejected


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Wraps `tokenizer.json` (through the `tokenizers` library) and the chat template."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in model folder {folder}")
        self._tokenizer = FastTokenizer.from_file(str(path))
        _turn_off_word_cache(self._tokenizer)
        self._settings = _read_settings(folder)
        self.chat_template: str | None = self._settings.get("chat_template")
        self.bos_token: str | None = _token_text(self._settings.get("bos_token"))
        self.eos_token: str | None = _token_text(self._settings.get("eos_token"))

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

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text: what llguidance indexes the vocabulary from."""
        return self._tokenizer.to_str()

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise RequestRejected("no_chat_template", "this model has no chat template; use completions instead")
        from jinja2.exceptions import TemplateError

        try:
            return _compile_template(self.chat_template).render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError:
            # The template's own message may quote the conversation, so it is not passed on.
            raise RequestRejected(
                "invalid_messages", "the model's chat template does not accept these messages (check roles and order)"
            ) from None

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # Templates write the BOS token themselves, so special tokens are not added a second time.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


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
    except json.JSONDecodeError:
        raise ModelLoadError(f"tokenizer_config.json in {folder} is not valid JSON") from None
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {entry.get("name"): entry.get("template") for entry in template}
        settings["chat_template"] = named.get("default") or next(iter(named.values()), None)
    return settings


def _token_text(value: str | dict | None) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str):
    from jinja2 import StrictUndefined
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    # The template comes from the model folder: render it sandboxed.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)
