"""The node's HPKE keys: generated in memory at boot, rotated on a timer, never exported.

After a rotation the previous key keeps opening requests for a grace period, so clients that
fetched the directory just before the rotation are still served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ohttp.keys import KeyPair, KeyRing, generate_key_pair


class NodeKeys:
    def __init__(self, rotation_s: float, grace_s: float, on_rotate: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._key_id = 0
        self.keyring = KeyRing(generate_key_pair(self._key_id))
        self.rotation_s = rotation_s
        self.grace_s = grace_s
        self._on_rotate = on_rotate
        self._previous_expires_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def current(self) -> KeyPair:
        return self.keyring.current

    def rotate(self) -> None:
        with self._lock:
            self._key_id = (self._key_id + 1) % 256
            self.keyring.rotate(generate_key_pair(self._key_id))
            self._previous_expires_at = time.monotonic() + self.grace_s
        if self._on_rotate is not None:
            self._on_rotate()

    def expire_previous(self) -> None:
        with self._lock:
            if self._previous_expires_at is not None and time.monotonic() >= self._previous_expires_at:
                self.keyring.drop_previous()
                self._previous_expires_at = None

    def start(self) -> None:
        if self.rotation_s > 0:
            self._thread = threading.Thread(target=self._run, name="veil-key-rotation", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_rotation = time.monotonic() + self.rotation_s
        while not self._stop.wait(1.0):
            self.expire_previous()
            if time.monotonic() >= next_rotation:
                self.rotate()
                next_rotation = time.monotonic() + self.rotation_s
