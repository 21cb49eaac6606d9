"""The one place Redis clients are built, with the options each side needs. A ``sentinel://``
URL (see redis_sentinel.py) gives a client of the master its sentinels name: on a connection
error, or READONLY from a demoted master, redis-py's sentinel pool asks them again, so every
client follows a failover by itself."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from llmq.common.transport.keys import Keys
from llmq.common.transport.redis_cluster import is_cluster_url, parse_cluster_url
from llmq.common.transport.redis_sentinel import is_sentinel_url, parse_sentinel_url

DEFAULT_SENTINEL_MASTER = "mymaster"
# Retries of a command on a connection error: about 0.7 s against one server (a restart);
# about 9.5 s behind sentinels, so a command sent while they elect a new master waits for it
# instead of failing its request (a failover takes down-after-milliseconds plus an election).
RETRIES = 3
SENTINEL_RETRIES = 12


def async_redis_options(retries: int = RETRIES) -> dict:
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
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, RuntimeError],
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        "driver_info": None,
    }


def _sentinel_kwargs(asynchronous: bool) -> dict:
    """Options of the connections to the sentinels themselves: short timeouts (a dead sentinel
    is skipped for the next), no SETINFO and no maintenance notifications either."""
    from redis.maint_notifications import MaintNotificationsConfig

    kwargs: dict = {"socket_connect_timeout": 2, "socket_timeout": 2, "driver_info": None}
    if asynchronous:
        kwargs["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return kwargs


class _MasterConnection(aiosentinel.SentinelManagedConnection):
    """Asks the sentinels for the master on every connect. redis-py's asyncio connection asks
    only in connect(); a command retried after a connection error reconnects through
    connect_check_health() to the dead master's address, so the first command after a failover
    failed on every pooled connection."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The master's pool that waits for a free connection, as the plain blocking pool does."""


def async_client(
    url: str, max_connections: int | None = None, sentinel_master: str = DEFAULT_SENTINEL_MASTER
) -> aioredis.Redis:
    """An asyncio client (the API, batch tasks). With ``max_connections``, a blocking pool: a
    burst waits for a free connection instead of failing with "Too many connections" (redis-py's
    default pool raises past 100)."""
    if is_cluster_url(url):
        return _async_cluster(url, max_connections)
    if is_sentinel_url(url):
        address = parse_sentinel_url(url)
        manager = aiosentinel.Sentinel(
            address.sentinels,
            sentinel_kwargs=_sentinel_kwargs(asynchronous=True),
            **async_redis_options(SENTINEL_RETRIES),
            **address.master_kwargs(),
        )
        if max_connections is None:
            return manager.master_for(sentinel_master, connection_class=_MasterConnection)
        return manager.master_for(
            sentinel_master,
            connection_class=_MasterConnection,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=10,
        )
    if max_connections is None:
        return aioredis.Redis.from_url(url, **async_redis_options())
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10, **async_redis_options()
    )
    return aioredis.Redis(connection_pool=pool)


def _async_cluster(url: str, max_connections: int | None):
    """A Redis Cluster's asyncio client: it learns the nodes from the URL's and follows
    MOVED and failovers itself."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    address = parse_cluster_url(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
        max_connections=max_connections or 2**31,
        socket_connect_timeout=5,
        **address.kwargs(),
    )


def _sync_client(url: str, sentinel_master: str, **options) -> redis.Redis:
    if is_cluster_url(url):
        from redis.cluster import ClusterNode, RedisCluster

        address = parse_cluster_url(url)
        nodes = [ClusterNode(host, port) for host, port in address.nodes]
        return RedisCluster(startup_nodes=nodes, **options, **address.kwargs())
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    address = parse_sentinel_url(url)
    manager = redis.sentinel.Sentinel(
        address.sentinels,
        sentinel_kwargs=_sentinel_kwargs(asynchronous=False),
        **options,
        **address.master_kwargs(),
    )
    return manager.master_for(sentinel_master)


def engine_client(url: str, sentinel_master: str = DEFAULT_SENTINEL_MASTER) -> redis.Redis:
    """The engine loop's synchronous client: a long socket timeout (a blocking XREADGROUP), and
    errors raised to the loop, which retries with backoff."""
    return _sync_client(
        url,
        sentinel_master,
        socket_timeout=30,
        socket_connect_timeout=5,
        health_check_interval=10,
        driver_info=None,  # no CLIENT SETINFO: Redis before 7.2 refuses it
    )


def tool_client(url: str, sentinel_master: str = DEFAULT_SENTINEL_MASTER) -> redis.Redis:
    """A command-line tool's synchronous client: fails fast when Redis is not there."""
    return _sync_client(url, sentinel_master, socket_connect_timeout=5, driver_info=None)


def keys_for(settings) -> Keys:
    """The key names of the configured Redis (hash-tagged in a cluster)."""
    return Keys(settings.key_prefix, cluster=is_cluster_url(settings.redis_url_or_default()))
