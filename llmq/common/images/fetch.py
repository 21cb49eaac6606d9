"""Image links fetched by the API with a size and time limit, never from a private, loopback,
link-local, multicast or otherwise non-public address (cloud metadata at 169.254.169.254
among them) unless LLMQ_IMAGE_FETCH_ALLOW names its host or network.

The host's name is resolved here and every address it resolves to is checked; the connection
then goes to a checked address (the name in Host and TLS's SNI), so a second resolution cannot
swap in another address. Redirects are followed by hand, each hop checked the same way."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from functools import lru_cache

import httpx

from llmq.common.images.decode import image_error
from llmq.common.settings import get_settings

MAX_REDIRECTS = 5
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Allowlist:
    hosts: frozenset[str]
    networks: tuple[Network, ...]

    def allows(self, host: str, address: Address) -> bool:
        return host.lower() in self.hosts or any(address in n for n in self.networks)


@lru_cache(maxsize=8)
def allowlist(spec: str) -> Allowlist:
    """LLMQ_IMAGE_FETCH_ALLOW read: each entry a network (an address alone is one) or a host."""
    hosts, networks = set(), []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            hosts.add(entry.lower())
    return Allowlist(frozenset(hosts), tuple(networks))


def public(address: Address) -> bool:
    """A globally routable unicast address (an IPv4-mapped IPv6 one judged as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


async def checked_address(url: httpx.URL, where: str, names: bool = True) -> Address | None:
    """The address to connect to for ``url``: every address its host resolves to is public
    or allowed, else a 400 naming the first that is not. ``names`` false: a host given by
    name is not resolved yet (None), an address is checked."""
    if url.scheme not in ("http", "https") or not url.host:
        raise image_error(where, "an image link must be an http(s) URL or a data URL")
    if not names and not _is_address(url.host):
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses = await resolve(url.host, port)
    except OSError as exc:
        raise image_error(
            where, f"the image link's host {url.host!r} does not resolve: {exc}"
        ) from None
    allowed = allowlist(get_settings().image_fetch_allow)
    for address in addresses:
        if not public(address) and not allowed.allows(url.host, address):
            raise image_error(
                where,
                f"the image link's host {url.host!r} resolves to {address}, a private, "
                "loopback, link-local or reserved address: not fetched (LLMQ_IMAGE_FETCH_ALLOW "
                "lets an operator allow it)",
            )
    return addresses[0]


async def fetch_image(url: str, where: str) -> bytes:
    """The body of ``url`` (at most LLMQ_MAX_IMAGE_BYTES, within LLMQ_IMAGE_FETCH_TIMEOUT)."""
    settings = get_settings()
    try:
        async with asyncio.timeout(settings.image_fetch_timeout):
            return await _follow(httpx.URL(url), where, settings.max_image_bytes)
    except TimeoutError:
        raise image_error(
            where,
            f"the image link took longer than {settings.image_fetch_timeout} s "
            "(LLMQ_IMAGE_FETCH_TIMEOUT)",
        ) from None
    except httpx.HTTPError as exc:
        raise image_error(where, f"the image link could not be fetched: {exc}") from None
    except httpx.InvalidURL as exc:
        raise image_error(where, f"the image link is not a valid URL: {exc}") from None


async def _follow(url: httpx.URL, where: str, most: int) -> bytes:
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            address = await checked_address(url, where)  # names=True: always an address
            host = f"[{address}]" if address and address.version == 6 else str(address)
            request = client.build_request(
                "GET",
                url.copy_with(host=host),
                headers={"Host": url.netloc.decode("ascii")},
                extensions={"sni_hostname": url.host},
            )
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = url.join(response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise image_error(
                        where, f"fetching the image link answered HTTP {response.status_code}"
                    )
                return await _body(response, where, most)
            finally:
                await response.aclose()
    raise image_error(where, f"the image link redirects more than {MAX_REDIRECTS} times")


async def _body(response: httpx.Response, where: str, most: int) -> bytes:
    too_large = image_error(
        where, f"the linked image is larger than {most} bytes (LLMQ_MAX_IMAGE_BYTES)"
    )
    if int(response.headers.get("content-length") or 0) > most:
        raise too_large
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > most:
            raise too_large
    return bytes(body)
