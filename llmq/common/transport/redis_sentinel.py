"""Redis Sentinel addresses: ``sentinel://[:PASSWORD@]HOST:PORT[/DB];sentinel://HOST:PORT...``,
the form of kombu's own sentinel broker transport, so one LLMQ_REDIS_URL serves the API, the
workers, Celery and Flower alike. The password (and db) of the first address are the master's;
the sentinels themselves answer without one, as with kombu."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEME = "sentinel"
DEFAULT_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    """Where the sentinels are and what to tell the master once they named it."""

    sentinels: list[tuple[str, int]]
    password: str | None = None
    username: str | None = None
    db: int = 0

    def master_kwargs(self) -> dict:
        """Connection options of the master's connections taken from the URL."""
        kwargs: dict = {"db": self.db}
        if self.password is not None:
            kwargs["password"] = self.password
        if self.username is not None:
            kwargs["username"] = self.username
        return kwargs


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The sentinels of a ``;``-separated ``sentinel://`` list. Raises ValueError on any other
    scheme, a part without a host, or a db that is not a number."""
    parts = [p.strip() for p in url.split(";") if p.strip()]
    if not parts:
        raise ValueError("empty Redis Sentinel URL")
    sentinels: list[tuple[str, int]] = []
    for part in parts:
        split = urlsplit(part)
        if split.scheme != SCHEME or not split.hostname:
            raise ValueError(f"not a sentinel://HOST:PORT address: {_redacted(part)!r}")
        sentinels.append((split.hostname, split.port or DEFAULT_PORT))
    first = urlsplit(parts[0])
    db_text = first.path.strip("/")
    if db_text and not db_text.isdigit():
        raise ValueError(f"the db of a Redis Sentinel URL is a number, not {db_text!r}")
    return SentinelAddress(
        sentinels=sentinels,
        password=unquote(first.password) if first.password is not None else None,
        username=unquote(first.username) if first.username else None,
        db=int(db_text) if db_text else 0,
    )


def _redacted(part: str) -> str:
    """An address as errors may show it: the password left out."""
    split = urlsplit(part)
    if split.password is None:
        return part
    return part.replace(f":{split.password}@", ":***@", 1)
