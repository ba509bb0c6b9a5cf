"""Tokenizer and chat template of a Hugging Face model folder.

Text a request carries is encoded as text: a control token it spells (`<|eot_id|>` in a message, in a
completion prompt) stays plain text, and only the template's own special tokens are control tokens
(engine/control_tokens.py), unless the node runs under a policy that lets users write control tokens
(`engine.control_tokens_in_content`). `encode` itself, the library call, reads special tokens as the
`tokenizers` library does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models

from engine.chat_template import ChatMessage, ChatTemplates, ToolCall
from engine.control_tokens import ControlTokens
from engine.errors import ModelLoadError, RequestRejected

__all__ = ["ChatMessage", "Tokenizer", "ToolCall"]


class Tokenizer:
    """Wraps `tokenizer.json` (through the `tokenizers` library) and the chat template."""

    def __init__(self, folder: str | Path, control_tokens_in_content: bool = False) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in model folder {folder}")
        self._tokenizer = FastTokenizer.from_file(str(path))
        _turn_off_word_cache(self._tokenizer)
        settings = _read_settings(folder)
        self.templates = ChatTemplates.load(folder, settings)
        self.control_tokens_in_content = control_tokens_in_content
        added = {token.content: token.special for token in self._tokenizer.get_added_tokens_decoder().values()}
        configured = settings.get("chat_control_tokens")  # transformers' list of a template's own tokens
        configured = configured if isinstance(configured, list) else None
        self._control = {with_tools: ControlTokens.of(added, self.templates.literal_text(with_tools), configured)
                         for with_tools in (False, True)}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode(self._tokenizer, text, add_special_tokens)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as plain text: a control token it spells is encoded as the characters it is made of."""
        return _encode(self._text_only, text, add_special_tokens)

    @functools.cached_property
    def _text_only(self) -> FastTokenizer:
        # Built on first use: a process that encodes no request text (the engine core) never pays for it.
        return _text_only(self._tokenizer)

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion prompt, with the tokens the tokenizer adds (BOS): text only, unless the policy allows."""
        return self.encode(prompt) if self.control_tokens_in_content else self.encode_text(prompt)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decoder(self) -> Callable[[list[int]], str]:
        """`decode` as one call into the library, without this wrapper's frame (per sample per step)."""
        return functools.partial(self._tokenizer.decode, skip_special_tokens=True)

    def keeping_decoder(self, kept: frozenset[int]) -> Callable[[list[int]], str]:
        """`decode` that keeps the special tokens in `kept` in the text and leaves out every other one."""
        dropped = self.special_token_ids - kept
        decode = self._tokenizer.decode

        def decode_keeping(token_ids: list[int]) -> str:
            return decode([t for t in token_ids if t not in dropped], skip_special_tokens=False)

        return decode_keeping

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The added tokens marked special: what a decode leaves out of the text by default."""
        return frozenset(t for t, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    def special_ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those of `texts` that are special tokens of this vocabulary (others are text anyway)."""
        ids = (self._tokenizer.token_to_id(text) for text in texts)
        return frozenset(t for t in ids if t in self.special_token_ids)

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
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The conversation as the model's template writes it; `tools` as OpenAI's function tools (JSON schemas);
        `template_kwargs`: more template variables (`chat_template_kwargs`)."""
        return self.templates.render(messages, tools, add_generation_prompt, template_kwargs=template_kwargs)

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        # Templates write the BOS token themselves, so special tokens are not added a second time.
        if self.control_tokens_in_content:
            text = self.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs)
            return self.encode(text, add_special_tokens=False)
        control = self._control[tools is not None]
        rendered = self.templates.render(messages, tools, add_generation_prompt=True, mark=control.mark,
                                         template_kwargs=template_kwargs)
        return self._encode_marked(control.pieces(rendered))

    def _encode_marked(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Pieces of a rendered chat: marked control tokens as text, the rest (the template's tokens) as usual."""
        (first, _), rest = pieces[0], pieces[1:]
        ids = self.encode(first, add_special_tokens=False)
        newline = self.encode("\n", add_special_tokens=False)
        for piece, as_text in rest:
            encode = self.encode_text if as_text else self.encode
            # After a newline, so that SentencePiece adds no word-start space in the middle of a chat (transformers').
            piece_ids = encode("\n" + piece, add_special_tokens=False)
            ids += piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(piece, False)
        return ids


def _encode(tokenizer: FastTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    except (TypeError, ValueError):  # e.g. lone surrogates: not text the tokenizer can read
        raise RequestRejected("invalid_text", "the text is not valid Unicode") from None
    finally:
        _forget_words(tokenizer)


def _text_only(tokenizer: FastTokenizer) -> FastTokenizer:
    """A copy that matches no added token in text: every one made special, and special ones read as text.

    (The library's `encode_special_tokens` alone still matches the added tokens that are not special.)
    """
    settings = json.loads(tokenizer.to_str())
    for token in settings.get("added_tokens") or []:
        token["special"] = True
    copy = FastTokenizer.from_str(json.dumps(settings))
    copy.encode_special_tokens = True
    _turn_off_word_cache(copy)
    return copy


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
