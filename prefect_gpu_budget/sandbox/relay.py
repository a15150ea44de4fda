"""The relay of the holder's `--proxy`: the isolated job's one way out, to the admin's proxy.

It is forked by the holder before the job's PID namespace is made, so the job sees it in
none of its /proc; it then drops to the job's user (with no capability left, and
undumpable, so that user cannot trace it or read its /proc either), bounds its open files,
and carries each connection made to the job's `127.0.0.1:PROXY_PORT` to the proxy in one
thread, one event loop. At most MAX_CONNECTIONS are carried at once; past that it accepts no
more until one ends (they wait in the listener's backlog). Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import selectors
import socket

MAX_CONNECTIONS = 256
"""Connections the relay carries at once; more wait in the backlog."""
BUFFER = 1 << 16
"""What is read from one side before it is written to the other."""


def drop_to(user: tuple[int, int] | None) -> None:  # pragma: no cover - in the relay
    """Become `user` (uid, gid; no supplementary groups), with no new privileges, and bound
    the open files to what MAX_CONNECTIONS needs."""
    if user is not None and os.geteuid() == 0:
        uid, gid = user
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise PermissionError(f"relay: could not switch to uid {uid}")
    fds = 2 * MAX_CONNECTIONS + 16
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY:
        fds = min(fds, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds))


class _Pair:
    """One carried connection: the job's side and the proxy's, each with what is still to be
    written to it."""

    def __init__(self, job: socket.socket, proxy: socket.socket) -> None:
        self.job, self.proxy = job, proxy
        self.pending: dict[socket.socket, bytes] = {job: b"", proxy: b""}
        self.ended: set[socket.socket] = set()  # sides that sent their end
        self.connecting = True  # until the proxy's side is connected

    def other(self, sock: socket.socket) -> socket.socket:
        return self.proxy if sock is self.job else self.job


class Relay:
    """Carries each connection `listener` accepts to `target`, in one event loop."""

    def __init__(self, listener: socket.socket, family: int, address: tuple) -> None:
        self.listener, self.family, self.target = listener, family, address
        self.select = selectors.DefaultSelector()
        self.pairs: dict[socket.socket, _Pair] = {}
        self.carried = 0
        listener.setblocking(False)
        self.select.register(listener, selectors.EVENT_READ)

    def run(self) -> None:  # pragma: no cover - the relay's life
        while True:
            for key, events in self.select.select():
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                else:
                    self._serve(sock, events)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        proxy = socket.socket(self.family, socket.SOCK_STREAM)
        conn.setblocking(False)
        proxy.setblocking(False)
        if proxy.connect_ex(self.target) not in (0, errno.EINPROGRESS):
            conn.close()
            proxy.close()
            return
        pair = _Pair(conn, proxy)
        self.pairs[conn] = self.pairs[proxy] = pair
        self.select.register(proxy, selectors.EVENT_WRITE)  # once connected
        self.carried += 1
        if self.carried >= MAX_CONNECTIONS:
            self.select.unregister(self.listener)

    def _serve(self, sock: socket.socket, events: int) -> None:
        pair = self.pairs.get(sock)
        if pair is None:
            return
        other = pair.other(sock)
        try:
            if pair.connecting:  # the proxy's side, writable: connected, or refused
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error))
                pair.connecting = False
                self._watch(pair)
                return
            if events & selectors.EVENT_WRITE:
                self._flush(pair, sock)
            if events & selectors.EVENT_READ and not pair.pending[other]:
                data = sock.recv(BUFFER)
                if data:
                    pair.pending[other] = data
                    self._flush(pair, other)
                else:
                    pair.ended.add(sock)
                    with contextlib.suppress(OSError):
                        other.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                self._close(pair)
                return
        if len(pair.ended) == 2:
            self._close(pair)
            return
        self._watch(pair)

    def _flush(self, pair: _Pair, sock: socket.socket) -> None:
        data = pair.pending[sock]
        if data:
            sent = sock.send(data)
            pair.pending[sock] = data[sent:]

    def _watch(self, pair: _Pair) -> None:
        """Read a side while the other has nothing waiting; write a side that has."""
        for side in (pair.job, pair.proxy):
            events = 0
            if side not in pair.ended and not pair.pending[pair.other(side)]:
                events |= selectors.EVENT_READ
            if pair.pending[side]:
                events |= selectors.EVENT_WRITE
            key = self.select.get_map().get(side)
            if events and key is None:
                self.select.register(side, events)
            elif events and key.events != events:
                self.select.modify(side, events)
            elif not events and key is not None:
                self.select.unregister(side)

    def _close(self, pair: _Pair) -> None:
        for side in (pair.job, pair.proxy):
            if self.pairs.pop(side, None) is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.select.unregister(side)
                side.close()
        if self.carried >= MAX_CONNECTIONS:
            self.select.register(self.listener, selectors.EVENT_READ)
        self.carried -= 1


def serve(channel: int, target: tuple[str, int], user: tuple[int, int] | None) -> None:
    """The relay's life (`spawn.spawn_relay`): find `target`'s address, drop to `user`
    (after which the standard library may be out of reach: nothing more is imported), take
    the listener the job's pid 1 hands over `channel`, and carry connections to `target`
    until the listener goes."""
    family, _, _, _, address = socket.getaddrinfo(*target, type=socket.SOCK_STREAM)[0]
    drop_to(user)
    with socket.socket(fileno=channel) as sock:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
    if not fds:
        return  # the job's pid 1 failed before it listened
    with socket.socket(fileno=fds[0]) as listener:
        Relay(listener, family, address).run()
