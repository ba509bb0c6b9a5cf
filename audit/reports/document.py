"""A report as a list of blocks, rendered to Markdown (with PNG files beside it)
and to a self-contained HTML page (the same PNGs inlined as base64).

Every string in a report comes from validated audit events (identifiers,
numbers, labels), but the HTML is escaped anyway.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

RED_MARK = "✗ RED LINE:"
WARN_MARK = "⚠"

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 70em; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }
th { background: #eee; }
td:first-child, th:first-child { text-align: left; font-family: monospace; }
tr.red td { background: #fdd; color: #a00; font-weight: bold; }
p.red { color: #fff; background: #c00; padding: 0.4em; font-weight: bold; }
p.warn { background: #ffe8b0; padding: 0.4em; }
p.pass { background: #dfd; padding: 0.4em; font-weight: bold; }
img { max-width: 100%; }
"""


@dataclass(frozen=True, slots=True)
class WrittenReport:
    """Paths of a written report; `passed` is False when it contains a red line."""

    markdown: Path
    html: Path
    images: tuple[Path, ...]
    passed: bool


@dataclass(frozen=True, slots=True)
class Table:
    """A table; rows whose index is in `red_rows` are red lines."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    red_rows: frozenset[int] = frozenset()


@dataclass(slots=True)
class Document:
    """A report under construction: headings, paragraphs, tables, red lines and images."""

    title: str
    blocks: list[tuple[str, object]] = field(default_factory=list)

    def heading(self, text: str) -> None:
        self.blocks.append(("heading", text))

    def paragraph(self, text: str) -> None:
        self.blocks.append(("paragraph", text))

    def verdict(self, text: str, passed: bool) -> None:
        self.blocks.append(("pass" if passed else "red", text))

    def red_line(self, text: str) -> None:
        self.blocks.append(("red", text))

    def warning(self, text: str) -> None:
        self.blocks.append(("warn", text))

    def table(self, table: Table) -> None:
        self.blocks.append(("table", table))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("image", (path, alt)))

    def to_markdown(self) -> str:
        parts = [f"# {self.title}"]
        for kind, content in self.blocks:
            parts.append(_MARKDOWN[kind](content))
        return "\n\n".join(parts) + "\n"

    def to_html(self) -> str:
        body = "\n".join(_HTML[kind](content) for kind, content in self.blocks)
        title = html.escape(self.title)
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
                f"<style>{_CSS}</style></head>\n<body>\n<h1>{title}</h1>\n{body}\n</body></html>\n")

    def write(self, out_dir: Path, stem: str) -> tuple[Path, Path]:
        """Write `<stem>.md` and `<stem>.html` into `out_dir`; returns both paths."""
        markdown_path, html_path = out_dir / f"{stem}.md", out_dir / f"{stem}.html"
        markdown_path.write_text(self.to_markdown(), encoding="utf-8")
        html_path.write_text(self.to_html(), encoding="utf-8")
        return markdown_path, html_path


def _markdown_table(table: Table) -> str:
    lines = ["| " + " | ".join(table.headers) + " |",
             "|" + "|".join(["---"] * len(table.headers)) + "|"]
    for index, row in enumerate(table.rows):
        cells = [f"**{cell}**" for cell in row] if index in table.red_rows else list(row)
        if index in table.red_rows:
            cells[0] = f"{RED_MARK} {cells[0]}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table.headers)
    rows = []
    for index, row in enumerate(table.rows):
        css = ' class="red"' if index in table.red_rows else ""
        cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
        rows.append(f"<tr{css}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _html_image(content: object) -> str:
    path, alt = content  # type: ignore[misc]
    encoded = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"></p>'


_MARKDOWN = {
    "heading": lambda text: f"## {text}",
    "paragraph": lambda text: str(text),
    "pass": lambda text: f"**✓ {text}**",
    "red": lambda text: f"**{RED_MARK} {text}**",
    "warn": lambda text: f"{WARN_MARK} {text}",
    "table": _markdown_table,
    "image": lambda content: f"![{content[1]}]({Path(content[0]).name})",
}

_HTML = {
    "heading": lambda text: f"<h2>{html.escape(text)}</h2>",
    "paragraph": lambda text: f"<p>{html.escape(text)}</p>",
    "pass": lambda text: f'<p class="pass">✓ {html.escape(text)}</p>',
    "red": lambda text: f'<p class="red">{RED_MARK} {html.escape(text)}</p>',
    "warn": lambda text: f'<p class="warn">{WARN_MARK} {html.escape(text)}</p>',
    "table": _html_table,
    "image": _html_image,
}
