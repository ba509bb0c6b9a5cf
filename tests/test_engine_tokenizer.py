"""The model folder's tokenizer and chat template, through the engine's `Tokenizer`."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer as FastTokenizer

from engine import EngineConfig, LLMEngine, ModelLoadError, RequestRejected, SamplingParams
from engine.tiny import BOS, EOT
from engine.tokenizer import ChatMessage, Tokenizer
from tests.engine_models import tiny_model_dir

CONVERSATION = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello, world!")]


def test_encode_adds_bos_once_and_decode_round_trips():
    tokenizer = Tokenizer(tiny_model_dir())
    ids = tokenizer.encode("The quick brown fox")
    assert ids[0] == tokenizer.token_id(BOS) and ids.count(ids[0]) == 1
    assert tokenizer.decode(ids) == "The quick brown fox"
    assert tokenizer.encode("The quick brown fox", add_special_tokens=False) == ids[1:]
    # Byte-level BPE: every byte has a token, plus merges; the model's embedding table may be larger (padding).
    assert 256 + 5 < tokenizer.vocab_size <= 768


def test_chat_template_renders_the_conversation():
    tokenizer = Tokenizer(tiny_model_dir())
    text = tokenizer.apply_chat_template(CONVERSATION)
    assert text == (
        f"{BOS}<|start_header_id|>system<|end_header_id|>\n\nBe brief.{EOT}"
        f"<|start_header_id|>user<|end_header_id|>\n\nHello, world!{EOT}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False).endswith("\n\n")


def test_encode_chat_does_not_add_a_second_bos():
    tokenizer = Tokenizer(tiny_model_dir())
    ids = tokenizer.encode_chat(CONVERSATION)
    assert ids.count(tokenizer.token_id(BOS)) == 1 and ids[0] == tokenizer.token_id(BOS)
    assert ids.count(tokenizer.token_id(EOT)) == 2


def copy_with_settings(tmp_path, settings: dict | None):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), folder)
    path = folder / "tokenizer_config.json"
    if settings is None:
        path.unlink()
    else:
        path.write_text(json.dumps(settings))
    return folder


def test_no_chat_template_is_a_request_error(tmp_path):
    tokenizer = Tokenizer(copy_with_settings(tmp_path, None))
    with pytest.raises(RequestRejected) as raised:
        tokenizer.apply_chat_template(CONVERSATION)
    assert raised.value.reason == "no_chat_template"


def test_named_templates_use_the_default_one(tmp_path):
    settings = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}"}]}
    assert Tokenizer(copy_with_settings(tmp_path, settings)).apply_chat_template(CONVERSATION) == "Be brief."


def test_a_template_error_does_not_quote_the_conversation(tmp_path):
    settings = {"chat_template": "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('bad role in: ' + m['content']) }}{% endif %}{% endfor %}"}
    tokenizer = Tokenizer(copy_with_settings(tmp_path, settings))
    with pytest.raises(RequestRejected) as raised:
        tokenizer.apply_chat_template([ChatMessage("system", "CANARY-chat-3141")])
    assert raised.value.reason == "invalid_messages"
    assert "CANARY" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_template_runs_sandboxed(tmp_path):
    settings = {"chat_template": "{{ messages.__class__.__mro__ }}"}
    tokenizer = Tokenizer(copy_with_settings(tmp_path, settings))
    with pytest.raises(Exception) as raised:
        tokenizer.apply_chat_template(CONVERSATION)
    assert "SecurityError" in type(raised.value).__name__ or isinstance(raised.value, RequestRejected)


def test_malformed_tokenizer_config_is_a_load_error(tmp_path):
    folder = copy_with_settings(tmp_path, {})
    (folder / "tokenizer_config.json").write_text("{ nope")
    with pytest.raises(ModelLoadError):
        Tokenizer(folder)


# ----- no word cache ------------------------------------------------------------------------

CANARY_WORDS = " zebraquokkacanary"  # not in the tiny vocabulary whole: several merged pieces


def fresh_tokenizer() -> FastTokenizer:
    return FastTokenizer.from_file(str(tiny_model_dir() / "tokenizer.json"))


def word_is_cached(tokenizer: FastTokenizer, word: str) -> bool:
    """Whether the BPE model answers `word` from its cache: a changed model splits an uncached word otherwise.

    With a continuing-subword prefix no merged piece is in the vocabulary any more, so only a cached
    answer still gives the tokens the unchanged model gives. (This changes `tokenizer`: probe it last.)
    """
    unchanged = fresh_tokenizer().encode(word, add_special_tokens=False).ids
    tokenizer.model.continuing_subword_prefix = "##"
    return tokenizer.encode(word, add_special_tokens=False).ids == unchanged


def test_the_cache_probe_sees_a_cached_word_and_only_that():
    """Control: the library's default tokenizer keeps the word, and the probe tells it from a new one."""
    tokenizer = fresh_tokenizer()
    tokenizer.encode(f"Hello{CANARY_WORDS}!")
    assert word_is_cached(tokenizer, CANARY_WORDS)
    assert not word_is_cached(fresh_tokenizer(), CANARY_WORDS)


def test_a_served_prompt_leaves_no_word_in_the_tokenizer():
    engine = LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=16, block_size=4))
    engine.generate([f"Hello{CANARY_WORDS}!"], SamplingParams(max_tokens=3, temperature=0.0))
    assert not engine.has_unfinished()
    assert not word_is_cached(engine.tokenizer._tokenizer, CANARY_WORDS)


def test_an_encoded_conversation_leaves_no_word_in_the_tokenizer():
    tokenizer = Tokenizer(tiny_model_dir())
    tokenizer.encode_chat([ChatMessage("user", f"Hello{CANARY_WORDS}!")])
    assert not word_is_cached(tokenizer._tokenizer, CANARY_WORDS)


def test_words_are_forgotten_after_each_encode_even_where_the_cache_keeps_some():
    """As a library version that keeps a few words at capacity zero would: the clear after encode still runs."""
    tokenizer = Tokenizer(tiny_model_dir())
    tokenizer._tokenizer.model._resize_cache(10_000)
    tokenizer.encode(f"Hello{CANARY_WORDS}!")
    assert not word_is_cached(tokenizer._tokenizer, CANARY_WORDS)
