"""What a secret looks like when STAR shows it: the one redaction rule.

:func:`redact_url` masks a URL's password (``redis://star:***@host``);
:func:`redact_text` also masks given secret values (``redis.password``,
``proxy.api_key``, ``cluster.secret``) wherever they occur. ``star config
show``, ``star status``, every log line and every error a user reads go
through these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
# scheme://user:password@ ; the password runs to the last "@" of the authority,
# as urllib reads it (an unencoded "@" in a password is masked with the rest).
_URL_PASSWORD = re.compile(r"\b(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:)(?P<pw>[^/\s]*)@")
# A shorter secret would mask unrelated text in every line; `star config show`
# masks secrets of any length.
MIN_REDACTED = 4


def redact_url(url: str) -> str:
    """``url`` (or any text) with each URL password replaced by ``***``; the user name stays."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", url)


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL passwords and every given secret value masked."""
    for value in sorted(secrets, key=len, reverse=True):
        if len(value) >= MIN_REDACTED:
            text = text.replace(value, MASK)
    return redact_url(text)
