"""Every path at which a unix socket of this host can be reached from this mount namespace:
what an isolated job's pid 1 covers (`walls.mask_sockets`) before its command starts. Read in
the host's namespaces, before the job's own are made. Standard library only (the holder runs as
a file).

The kernel lists the sockets bound to a path per network namespace (`/proc/<pid>/net/unix`),
by the path the binding process gave, in its own mount namespace and from its own folder:

- every network namespace is read, through one process in each (a service started with a
  network of its own, a container, another job);
- a path that is no socket here (bound in another mount namespace, or relative to its
  process's folder) is followed through a process that holds the socket (`/proc/<pid>/fd`),
  to where its file lies in that process's mounts;
- a socket's file is shown at every path this namespace's mounts show it at (a folder bound at
  a second path, `mount --bind /run /srv/run`, shows every socket of /run there too);
- a path holding a newline continues on the next line of the listing.

What this cannot see: a socket moved or hard-linked elsewhere after it was bound (the kernel
keeps the first path), and one bound after the job started. Landlock's control of pathname
sockets, where the kernel has it, covers those (`walls.landlock_ruleset`).
"""

from __future__ import annotations

import os
import re
import stat

ENTRY = re.compile(
    rb"[0-9a-fA-F]+: [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{4} [0-9A-F]{2} +(\d+)(?: (.*))?"
)
"""An entry of /proc/net/unix: its socket's inode, then the path it is bound to, if any."""

Mount = tuple[str, str, str]
"""A mount: (device `major:minor`, its root within that filesystem, where it is mounted)."""


def bound(text: bytes) -> list[tuple[int, bytes]]:
    """(socket inode, path) of each socket of a /proc/<pid>/net/unix text that is bound to a
    path (abstract ones, `@...`, belong to their network namespace and are left out)."""
    entries: list[list] = []
    for line in text.split(b"\n")[1:]:
        match = ENTRY.fullmatch(line)
        if match:
            entries.append([int(match[1]), match[2] or b""])
        elif entries and entries[-1][1]:  # a newline in the path before
            entries[-1][1] += b"\n" + line
    return [(inode, path.rstrip(b"\n")) for inode, path in entries if path[:1] not in (b"", b"@")]


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def _namespaces() -> dict[str, str]:
    """Each network namespace of the host: a pid in it ("self" for this process's own)."""
    found = {os.readlink("/proc/self/ns/net"): "self"}
    for pid in _pids():
        try:
            found.setdefault(os.readlink(f"/proc/{pid}/ns/net"), pid)
        except OSError:
            continue
    return found


def _unescape(field: str) -> str:
    """A path as mountinfo writes it (space, tab, newline and backslash as octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts(pid: str = "self") -> list[Mount]:
    """The mounts of `pid`'s mount namespace."""
    found = []
    with open(f"/proc/{pid}/mountinfo") as handle:
        for line in handle:
            fields = line.split(" ")
            if len(fields) > 4:
                found.append((fields[2], _unescape(fields[3]), _unescape(fields[4])))
    return found


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def views(path: str, theirs: list[Mount], ours: list[Mount]) -> list[str]:
    """Every path `ours` shows the file at, that the mounts `theirs` show at `path`: its place
    in its filesystem (under the mount of `theirs` that holds it), then each mount of `ours`
    of the same filesystem whose root holds that place."""
    holding = [m for m in theirs if _under(path, m[2])]
    if not holding:
        return []
    device, root, point = max(reversed(holding), key=lambda m: len(m[2]))  # the top one
    inside = root.rstrip("/") + path[len(point.rstrip("/")) :]
    return [
        where.rstrip("/") + inside[len(base.rstrip("/")) :] or "/"
        for other, base, where in ours
        if other == device and _under(inside, base)
    ]


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _socket_owners(inodes: set[int]) -> dict[int, str]:
    """A process with each of the sockets `inodes` open (by its fds), as far as one is found."""
    found: dict[int, str] = {}
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                inode = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if inode is not None and inode not in found:
                found[inode] = pid
        if len(found) == len(wanted):
            break
    return found


def host_sockets() -> list[str]:
    """Every path this mount namespace shows a socket of the host at (see the module's doc)."""
    ours = mounts()
    found: list[str] = []
    elsewhere: dict[int, str] = {}
    for pid in _namespaces().values():
        try:
            with open(f"/proc/{pid}/net/unix", "rb") as handle:
                listed = bound(handle.read())
        except OSError:
            continue
        for inode, raw in listed:
            path = os.fsdecode(raw)
            if path.startswith("/") and _is_socket(path):
                found += [path, *views(os.path.realpath(path), ours, ours)]
            else:
                elsewhere[inode] = path
    for inode, pid in _socket_owners(set(elsewhere)).items():
        path = elsewhere[inode]
        try:
            if not path.startswith("/"):  # from its process's folder (where it is now)
                path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
            if _is_socket(f"/proc/{pid}/root{path}"):
                found += views(os.path.normpath(path), mounts(pid), ours)
        except OSError:
            continue
    return list(dict.fromkeys(found))
