"""A TCP relay of the multi-host tests: the load balancer in front of the API replicas (as the
Prefect docs put NGINX there), and the way into PostgreSQL for the hosts' namespaces.

`python -m tests.hosts.relay LISTEN TARGET [TARGET ...]` (each `host:port`; a LISTEN port 0
takes a free one) accepts on LISTEN and pipes each connection to the next target in turn
(round robin); a target that refuses the connection is skipped for that connection, so a dead
replica's share goes to the live ones. It writes `listening host:port` on its stdout once it
accepts, and runs until it is signalled. Each connection is relayed byte for byte both ways and
closed when either side closes: HTTP keep-alive and PostgreSQL's LISTEN connections pass
unchanged. It knows nothing of HTTP: a request in flight on a replica that dies fails, as it
would behind any TCP balancer.

The standard library only (asyncio), so it starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import sys

CONNECT_TIMEOUT_S = 5.0
CHUNK = 65536


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end; then close the other side's writing half."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Relay:
    """Round robin over `targets`, skipping those that refuse a connection."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self.targets = targets
        self._turn = itertools.cycle(range(len(targets)))

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        first = next(self._turn)
        for offset in range(len(self.targets)):
            host, port = self.targets[(first + offset) % len(self.targets)]
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError):
                continue
        return None

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:  # every target is down: the client sees its connection closed
            client_w.close()
            return
        server_r, server_w = upstream
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))


async def serve(listen: tuple[str, int], targets: list[tuple[str, int]]) -> None:
    relay = Relay(targets)
    server = await asyncio.start_server(relay.handle, *listen, backlog=1024)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m tests.hosts.relay LISTEN TARGET [TARGET ...]", file=sys.stderr)
        return 2
    asyncio.run(serve(_address(argv[0]), [_address(a) for a in argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
