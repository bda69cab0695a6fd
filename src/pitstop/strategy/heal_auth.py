"""How a heal request proves it comes from the job, asks for one step, and is not a replay: an HMAC-SHA256 (a key
derived from ``PITSTOP_FT_SECRET``) over method, path, step, a fresh nonce and the time; accepted within
:data:`WINDOW_S`, once (:class:`Nonces`). The server's and the client's side are in
:mod:`pitstop.strategy.heal_transport`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading

# A signed request is accepted for WINDOW_S seconds after its time, and as long before it (the clocks of a job's
# machines may differ by that much); its nonce is remembered as long. MAX_NONCES bounds that memory: only requests
# with a valid MAC are remembered, so only a holder of the secret could fill it (then 503 until they expire).
WINDOW_S = 30
MAX_NONCES = 16384
SCHEME = "PitstopHeal"
AUTH = re.compile(rf"{SCHEME} t=([0-9]{{1,12}}),n=([0-9a-f]{{32}}),m=([0-9a-f]{{64}})")
PATH = re.compile(r"/heal/([0-9a-f]{16})/([0-9]{1,19})")


def derive_keys(secret: str) -> tuple[bytes, bytes]:
    """(the key of the requests' MACs, the key of the answers' tags): both from the job's secret, neither is it,
    and neither is the other (a tag an answer carried is no request's MAC)."""
    key = secret.encode()
    request_key = hmac.new(key, b"pitstop heal: request key", hashlib.sha256).digest()
    return request_key, hmac.new(key, b"pitstop heal: tag key", hashlib.sha256).digest()


def request_mac(key: bytes, method: str, path: str, step: int, nonce: str, when: int) -> str:
    """The MAC of one request: what it asks for (method, path, step), once (nonce), now (time)."""
    message = f"pitstop heal request v1\n{method}\n{path}\n{step}\n{nonce}\n{when}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def authorization(key: bytes, path: str, step: int, nonce: str, when: int) -> str:
    """The ``Authorization`` header of a GET of ``path`` for ``step``, signed at ``when`` (Unix seconds)."""
    return f"{SCHEME} t={when},n={nonce},m={request_mac(key, 'GET', path, step, nonce, when)}"


class Nonces:
    """The nonces of the requests accepted within the window: a nonce is accepted once."""

    def __init__(self, window: float = WINDOW_S, limit: int = MAX_NONCES):
        self.window, self.limit = window, limit
        self._lock = threading.Lock()
        self._expiry: dict[str, float] = {}  # nonce -> when its request expires (insertion order ~ expiry order)

    def first_use(self, nonce: str, when: float, now: float) -> bool | None:
        """True the first time (remembered until ``when`` + the window), False again; None when full."""
        with self._lock:
            # (a request's time can be up to a window ahead of this clock: prune all that expired, not only the head)
            if len(self._expiry) >= self.limit or next(iter(self._expiry.values()), now) < now:
                self._expiry = {n: t for n, t in self._expiry.items() if t >= now}
            if nonce in self._expiry:
                return False
            if len(self._expiry) >= self.limit:
                return None
            self._expiry[nonce] = when + self.window
            return True
