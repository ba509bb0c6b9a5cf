"""Reading a log's files from a directory or over HTTP, bounded: a log is untrusted input to its monitor."""

from __future__ import annotations

from pathlib import Path

import httpx

from attestation.transparency.tiles import TILE_WIDTH, Fetch, parse_tile_path
from transparency.errors import LogFetchError

# The largest file a log serves: a full entry bundle of maximal entries.
MAX_FILE_BYTES = TILE_WIDTH * (2 + 0xFFFF)


def check_log_path(path: str) -> str:
    """`checkpoint` or a tile path, nothing else (no '..', no absolute path)."""
    if path != "checkpoint":
        parse_tile_path(path)
    return path


def directory_fetch(root: Path) -> Fetch:
    def fetch(path: str) -> bytes | None:
        target = root / check_log_path(path)
        try:
            with target.open("rb") as file:
                data = file.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise LogFetchError(f"cannot read {path} of the log ({error.strerror})") from None
        if len(data) > MAX_FILE_BYTES:
            raise LogFetchError(f"{path} of the log is larger than any log file can be")
        return data

    return fetch


def url_fetch(base_url: str, client: httpx.Client) -> Fetch:
    base = base_url.rstrip("/")

    def fetch(path: str) -> bytes | None:
        try:
            with client.stream("GET", f"{base}/{check_log_path(path)}") as answer:
                if answer.status_code == 404:
                    return None
                if answer.status_code != 200:
                    raise LogFetchError(f"the log answered {answer.status_code} for {path}")
                return _bounded(answer, path)
        except httpx.HTTPError as error:
            raise LogFetchError(f"cannot fetch {path} of the log ({type(error).__name__})") from None

    return fetch


def _bounded(answer: httpx.Response, path: str) -> bytes:
    parts, received = [], 0
    for part in answer.iter_bytes():
        received += len(part)
        if received > MAX_FILE_BYTES:
            raise LogFetchError(f"{path} of the log is larger than any log file can be")
        parts.append(part)
    return b"".join(parts)


def source_fetch(source: str, client: httpx.Client) -> Fetch:
    """A fetch for a directory path or an http(s) URL."""
    if source.startswith(("http://", "https://")):
        return url_fetch(source, client)
    root = Path(source)
    if not root.is_dir():
        raise LogFetchError(f"{source} is neither a directory nor an http(s) URL")
    return directory_fetch(root)
