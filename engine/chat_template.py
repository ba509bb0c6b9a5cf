"""A model folder's chat templates, rendered as `transformers.apply_chat_template` renders them.

Where the templates come from (transformers' order): `chat_template.jinja` and `chat_templates/NAME.jinja`
beside the tokenizer, else `chat_template` in tokenizer_config.json, a string or a list of named
templates. With several, "tool_use" renders a chat that gives tools and "default" every other.

How they render: a sandboxed Jinja environment with transformers' settings (trim_blocks, lstrip_blocks,
loop controls, its `tojson`, `raise_exception`, `strftime_now`, `namespace`, `dict`) and Jinja's
default, non-strict undefined, which real templates rely on (`message.tool_calls` of a plain message).
Messages reach the template as transformers passes them: plain dicts without the keys whose value is
None, tool calls in OpenAI's {"type": "function", "function": {"name", "arguments"}} shape with the
arguments as a dict. One exception: an assistant turn that only calls tools (OpenAI's `content: null`)
has the content its template expects, as vLLM gives it: "" (Qwen3's first template and vLLM's DeepSeek-R1
template use it as text), or None where the template itself tests `message['content'] is none`
(DeepSeek-R1's own). A template that fails on a conversation is a request error that never quotes it.

`render(..., mark=...)` passes every string of the messages and tools through `mark` first: how
engine/control_tokens.py tells the text a user wrote from the special tokens the template writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from engine.errors import ModelLoadError, RequestRejected

# transformers passes these from the tokenizer's settings to every template, when set.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A template's own refusal is shown only when it is literal text of the template (so not the conversation).
_MAX_SHOWN_REFUSAL = 200
_SHOWABLE = re.compile(r"[ -~]+")
# A template that tells a tool-calling turn by `message['content'] is none` (DeepSeek-R1's).
_TESTS_CONTENT_NONE = re.compile(r"""message\s*(?:\.\s*content|\[\s*['"]content['"]\s*\])\s+is\s+(?:not\s+)?none""")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call an assistant message made: OpenAI's id, the function's name, its arguments as a JSON object."""

    id: str
    name: str
    arguments: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ToolCall({len(self.arguments)} arguments)"  # reprs reach tracebacks: nothing the call says


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation. `content` is None for an assistant turn that only calls tools."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    name: str | None = None

    def __repr__(self) -> str:
        size = 0 if self.content is None else len(self.content)
        return f"ChatMessage({size} characters, {len(self.tool_calls)} tool calls)"

    def template_data(self, null_content: str | None = "") -> dict:
        """The message as transformers gives it to a template: keys set to None are left out, except an
        assistant's null content (a turn that only calls tools), which is `null_content`."""
        data: dict = {"role": self.role}
        if self.content is not None or self.role == "assistant":
            data["content"] = null_content if self.content is None else self.content
        if self.tool_calls:
            data["tool_calls"] = [_call_data(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            data["name"] = self.name
        return data


def _call_data(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatTemplates:
    """A model's templates, compiled once when the model loads (they are the model's, not a request's)."""

    def __init__(self, sources: dict[str, str], special_tokens: dict[str, str]) -> None:
        self._sources = sources
        self._compiled = {name: _compile(name, source) for name, source in sources.items()}
        self._null_content = {name: None if _TESTS_CONTENT_NONE.search(source) else ""
                              for name, source in sources.items()}
        self._special_tokens = special_tokens

    @classmethod
    def load(cls, folder: Path, settings: dict) -> ChatTemplates:
        tokens = {name: _token_text(settings[name]) for name in SPECIAL_TOKEN_NAMES if settings.get(name) is not None}
        return cls(_template_sources(folder, settings), {k: v for k, v in tokens.items() if v is not None})

    @property
    def available(self) -> bool:
        return bool(self._sources)

    def source(self, with_tools: bool) -> str | None:
        """The template text a chat renders with (None: the model has none)."""
        name = self._name(with_tools)
        return None if name is None else self._sources[name]

    def literal_text(self, with_tools: bool) -> str:
        """The template's own text: its raw text and string constants, joined by NULs (transformers' reading)."""
        name = self._name(with_tools)
        if name is None:
            return ""
        tree = self._compiled[name].environment.parse(self._sources[name])
        literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
        literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
        return "\0".join(sorted(literals))

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, add_generation_prompt: bool,
               mark: Callable[[object], object] = lambda data: data, template_kwargs: dict | None = None) -> str:
        """`template_kwargs`: more variables for the template (Qwen3's `enable_thinking`); they cannot replace
        the conversation, the tools or the special tokens."""
        name = self._name(tools is not None)
        if name is None:
            raise RequestRejected("no_chat_template", "this model has no chat template; use completions instead")
        context = {
            **mark(template_kwargs or {}),
            **self._special_tokens,
            "messages": mark([message.template_data(self._null_content[name]) for message in messages]),
            "tools": mark(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled[name].render(context)
        except _TemplateRefusal as refusal:  # messages first: the inner API names the field a refusal begins with
            raise RequestRejected("invalid_messages", self._refusal_text(name, refusal.text)) from None
        except Exception:  # noqa: BLE001 - the template is code run on the request's messages: any failure is theirs
            # Jinja's own message may quote the conversation, so it is not passed on.
            raise RequestRejected(
                "invalid_messages", "messages do not fit the model's chat template (check roles and order)"
            ) from None

    def _name(self, with_tools: bool) -> str | None:
        if len(self._sources) == 1:
            return next(iter(self._sources))
        if with_tools and "tool_use" in self._sources:
            return "tool_use"
        return "default" if "default" in self._sources else None

    def _refusal_text(self, name: str, text: str) -> str:
        literal = text in self._sources[name] and 0 < len(text) <= _MAX_SHOWN_REFUSAL and _SHOWABLE.fullmatch(text)
        if literal:
            return f"messages refused by the model's chat template: {text}"
        return "messages refused by the model's chat template (check roles and order)"


def _template_sources(folder: Path, settings: dict) -> dict[str, str]:
    """Template files beside the tokenizer win over tokenizer_config.json's `chat_template`, as in transformers."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = _read(folder / "chat_template.jinja")
    if (folder / "chat_templates").is_dir():
        files |= {path.stem: _read(path) for path in sorted((folder / "chat_templates").glob("*.jinja"))}
    if files:
        return files
    configured = settings.get("chat_template")
    if configured is None:
        return {}
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list) and all(_is_named_template(entry) for entry in configured):
        named = {entry["name"]: entry["template"] for entry in configured}
        if len(named) > 1 and "default" not in named:
            raise ModelLoadError("tokenizer_config.json names several chat templates but none 'default'")
        return named
    raise ModelLoadError("chat_template in tokenizer_config.json must be a string or a list of named templates")


def _is_named_template(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise ModelLoadError(f"cannot read the chat template {path.name}") from None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile(name: str, source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except TemplateError:
        raise ModelLoadError(f"the chat template {name!r} is not valid Jinja") from None


class _TemplateRefusal(TemplateError):
    """`raise_exception` called by the template itself."""

    def __init__(self, text: object) -> None:
        super().__init__("the chat template refused the messages")
        self.text = text if isinstance(text, str) else ""


def _raise_exception(text: object) -> None:
    raise _TemplateRefusal(text)


def _tojson(value: object, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which would change the rendered prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the type object itself (whose attributes reach CPython's internals)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """Jinja's `namespace()`, refusing underscore names (as transformers does) so a template cannot reach internals."""

    def __init__(*args, **kwargs) -> None:  # Jinja's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_attribute(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _check_attribute(name)
        Namespace.__setitem__(self, name, value)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError("chat templates cannot set underscore attributes on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}` tag marks the assistant's text for training masks; rendering keeps its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    # The template comes from the model folder and runs on a request's messages: sandboxed, immutable inputs.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                            "dict": _TemplateDict(), "namespace": _TemplateNamespace}
    return environment
