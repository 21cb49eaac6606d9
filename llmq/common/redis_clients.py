"""The one place Redis clients are built, with the options each side needs."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis


def async_redis_options() -> dict:
    """Connection options of every asyncio Redis client: a command that meets a dead pooled
    connection (Redis restarted) retries on a fresh one instead of failing the request. Under
    uvloop (uvicorn's loop) writing to a socket the peer closed raises RuntimeError, not
    redis-py's ConnectionError. Redis 8's maintenance notifications stay off: on a reconnect to
    an older Redis the refusal of CLIENT MAINT_NOTIFICATIONS reached a request as an error, and
    so did CLIENT SETINFO's (Redis before 7.2): about one restart in four answered a request 503
    "unknown subcommand 'SETINFO'"; no SETINFO is sent."""
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.maint_notifications import MaintNotificationsConfig

    return {
        "socket_connect_timeout": 5,
        "health_check_interval": 10,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, RuntimeError],
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        "driver_info": None,
    }


def async_client(url: str, max_connections: int | None = None) -> aioredis.Redis:
    """An asyncio client (the API, batch tasks). With ``max_connections``, a blocking pool: a
    burst waits for a free connection instead of failing with "Too many connections" (redis-py's
    default pool raises past 100)."""
    if max_connections is None:
        return aioredis.Redis.from_url(url, **async_redis_options())
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10, **async_redis_options()
    )
    return aioredis.Redis(connection_pool=pool)


def engine_client(url: str) -> redis.Redis:
    """The engine loop's synchronous client: a long socket timeout (a blocking XREADGROUP), and
    errors raised to the loop, which retries with backoff."""
    return redis.Redis.from_url(
        url,
        socket_timeout=30,
        socket_connect_timeout=5,
        health_check_interval=10,
        driver_info=None,  # no CLIENT SETINFO: Redis before 7.2 refuses it
    )


def tool_client(url: str) -> redis.Redis:
    """A command-line tool's synchronous client: fails fast when Redis is not there."""
    return redis.Redis.from_url(url, socket_connect_timeout=5, driver_info=None)
