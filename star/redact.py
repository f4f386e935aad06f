"""What a secret looks like when STAR shows it: the one redaction rule.

:func:`redact_url` masks every password a URL carries, in the forms redis-py
reads: the user-info (``redis://star:***@host``, ``rediss://:***@host``) and a
query parameter (``unix:///run/redis.sock?password=***&db=0``,
``redis://host/0?password=***``; redis-py passes each query parameter as a
connection argument, so any parameter whose name says password, secret, token,
key or auth is masked). The user name, the host, the path and the other
parameters stay. :func:`redact_text` also masks given secret values
(``redis.password``, ``proxy.api_key``, ``cluster.secret``) wherever they
occur; :func:`url_secrets` lists a URL's passwords, for those values.

``star config show``, ``star status``, every log line and every error a user
reads go through these; a URL-valued setting added later (a list of Sentinel
URLs, say) is masked by them as it is, in ``star config show`` and in errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, quote, unquote, urlsplit

MASK = "***"
# scheme://user:password@ ; the password runs to the last "@" of the authority,
# as urllib reads it (an unencoded "@" in a password is masked with the rest).
_URL_PASSWORD = re.compile(r"\b(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:)(?P<pw>[^/\s]*)@")
# ?password=... or &password=... : the value runs to the next parameter, the
# fragment, white space or a quote (a URL inside a repr or JSON string).
_QUERY_PARAM = re.compile(r"(?P<head>[?&](?P<name>[A-Za-z0-9_.~-]+)=)(?P<value>[^&#\s'\"]*)")
# Names of the parameters whose value is a secret: password, ssl_password,
# passwd, pwd, secret, token, api_key/apikey, key, auth, credentials...
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|api[_-]?key|auth|credential|^key$", re.I)
# A shorter secret would mask unrelated text in every line; `star config show`
# masks secrets of any length.
MIN_REDACTED = 4


def _secret_param(name: str) -> bool:
    return _SECRET_NAME.search(unquote(name)) is not None


def _mask_param(m: re.Match[str]) -> str:
    return f"{m['head']}{MASK}" if _secret_param(m["name"]) and m["value"] else m[0]


def redact_url(url: str) -> str:
    """``url`` (or any text) with each URL password replaced by ``***``; the user name stays.

    Both forms are masked: ``scheme://user:password@host`` and a secret query
    parameter (``?password=``, ``&ssl_password=``, ``?token=``...).
    """
    url = _QUERY_PARAM.sub(_mask_param, url)
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", url)


def url_secrets(url: str) -> set[str]:
    """The passwords ``url`` carries (user-info and secret query parameters), as
    written, percent-decoded and percent-encoded: the forms a line could show."""
    if "://" not in url:
        return set()
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
    except ValueError:  # a malformed port or IPv6 host: no user-info to read
        parts, found = None, []
    query = parts.query if parts is not None else url.partition("?")[2]
    for raw in query.split("&"):
        name, sep, value = raw.partition("=")
        if sep and _secret_param(name):
            found.append(value)
    found += [value for name, value in parse_qsl(query) if _secret_param(name)]
    out: set[str] = set()
    for value in filter(None, found):
        out.update({value, unquote(value), quote(unquote(value), safe="")})
    return out


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL passwords and every given secret value masked."""
    for value in sorted(secrets, key=len, reverse=True):
        if len(value) >= MIN_REDACTED:
            text = text.replace(value, MASK)
    return redact_url(text)
