"""TLS options of the Redis client: the ``redis.tls_*`` settings as redis-py arguments.

A ``rediss://`` URL makes redis-py open a TLS connection that verifies the
server's certificate and host name; ``redis.tls_ca_file`` names the CA to trust
(else the system's store), ``redis.tls_cert_file``/``tls_key_file`` a client
certificate for a server started with ``tls-auth-clients``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from star.redact import redact_url
from star.settings import RedisSettings, SettingsError

_FILES = {
    "tls_ca_file": "ssl_ca_certs",
    "tls_cert_file": "ssl_certfile",
    "tls_key_file": "ssl_keyfile",
}


def tls_kwargs(settings: RedisSettings) -> dict[str, Any]:
    """redis-py connection arguments for ``settings``' TLS files ({} without any).

    Raises :class:`SettingsError` for a file given with a URL that is not
    ``rediss://`` (it would be silently ignored) or a file that does not exist.
    """
    given = {name: getattr(settings, name) for name in _FILES if getattr(settings, name)}
    if not given:
        return {}
    if urlsplit(settings.url).scheme != "rediss":
        names = ", ".join(f"redis.{name}" for name in given)
        raise SettingsError(
            f"{names} set but redis.url {redact_url(settings.url)!r} is not rediss://; "
            "use a rediss:// URL for TLS or unset them"
        )
    if "tls_key_file" in given and "tls_cert_file" not in given:
        raise SettingsError("redis.tls_key_file is set without redis.tls_cert_file")
    for name, path in given.items():
        if not Path(path).is_file():
            raise SettingsError(f"redis.{name}: no such file {path!r}")
    return {"ssl_cert_reqs": "required", **{_FILES[name]: path for name, path in given.items()}}
