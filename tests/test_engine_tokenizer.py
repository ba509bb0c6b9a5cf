"""The model folder's tokenizer and chat template, through the engine's `Tokenizer`."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import ModelLoadError, RequestRejected
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
