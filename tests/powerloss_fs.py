"""A FUSE filesystem that forgets everything not made durable, for power-loss tests.

``kill -9`` keeps the kernel's page cache, so a store that never fsyncs passes a kill test. This
filesystem keeps two states: what the processes see (every write, create and rename) and what a
disk would still hold after the power went out, updated only by what POSIX promises:

- ``fsync``/``fdatasync`` (and ``msync``, which reaches us as fsync) of a file makes that file's
  bytes and size durable, not its name;
- ``fsync`` of a directory makes that directory's entries (creates, links, unlinks, renames)
  durable.

So a file created, written and fsynced whose directory was never fsynced is gone after a crash,
and a rename that was not followed by an fsync of the directory is undone. This is LazyFS's
model (Jepsen's FUSE filesystem for the same purpose), which cannot be fetched here.

It speaks the kernel's FUSE protocol on ``/dev/fuse`` itself, with no libfuse and nothing to
install: the mount is a ``mount(2)`` call (root only). It runs as its own process: a page fault
on a mapped file of this filesystem must be served while the faulting process holds its GIL.

    python tests/powerloss_fs.py MOUNTPOINT DURABLE_DIR

loads DURABLE_DIR (everything in it counts as durable), mounts, prints ``ready``, and obeys
lines on stdin:

- ``crash``: the power goes out. From now on every change fails with EIO (so nothing can be
  acknowledged after this instant); the durable state is written to DURABLE_DIR; prints
  ``crashed FILES DIRS``;
- ``crash SEED``: the power goes out in the middle of writeback. Each page written since its
  file's last fsync reaches the disk whole, not at all, or up to a 512-byte sector (chosen
  with ``random.Random(SEED)``), in no particular order, as a disk's cache leaves them; then as
  ``crash``, printing ``crashed FILES DIRS PAGES`` (PAGES: pages that landed whole or in part);
- ``exit``: unmount and exit (after ``crash``; the processes using the mount are gone by then);
- ``fail-fsync SIZE``: the next fsync of a file of SIZE bytes fails with EIO and its unwritten
  pages are dropped, as Linux does after a writeback error (a later fsync then succeeds
  without them);
- ``fail-write SIZE``: the next ``write(2)`` (not a writeback of mapped or cached pages) to a
  file of SIZE bytes fails with EIO and stores nothing, and later writes succeed again: a
  device that failed one write and came back, which a store must not take as healed;
- ``fail-lseek SIZE``: from now on every ``SEEK_DATA``/``SEEK_HOLE`` of a file of SIZE bytes
  fails with EIO (a disk that cannot read the file's extent map; other lseeks never reach
  this filesystem);
- ``stats``: prints ``stats FSYNCS DIR_FSYNCS WRITES_FAILED``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import shutil
import stat
import struct
import sys
import threading
import time
from pathlib import Path

PAGE = 4096

# Opcodes (linux/fuse.h).
LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK = 8, 9, 10, 11, 12, 13
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
FSYNC, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 20, 25, 26, 27, 28, 29, 30
ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE = 34, 35, 36, 38, 42, 43
RENAME2, LSEEK = 45, 46
NO_REPLY = (FORGET, BATCH_FORGET, INTERRUPT)

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ext, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT = struct.Struct("<QQQQII")  # + attr
ATTR_OUT = struct.Struct("<QII")  # + attr
OPEN_OUT = struct.Struct("<QII")
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
READ_IN = struct.Struct("<QQIIQII")
WRITE_IN = struct.Struct("<QQIIQII")
FSYNC_IN = struct.Struct("<QII")
FALLOCATE_IN = struct.Struct("<QQQII")
LSEEK_IN = struct.Struct("<QQII")  # fh, offset, whence, padding
SEEK_DATA, SEEK_HOLE = 3, 4
DIRENT = struct.Struct("<QQII")
STATFS_OUT = struct.Struct("<QQQQQIIII6I")

FUSE_WRITE_CACHE = 1  # a write's flag: a writeback of cached pages, not a write(2) call
FATTR_MODE, FATTR_SIZE, FATTR_ATIME, FATTR_MTIME = 1, 8, 16, 32
FUSE_BIG_WRITES = 1 << 5
FOPEN_KEEP_CACHE = 2
MAX_WRITE = 128 * 1024
VALID_S = 3600  # the kernel may cache names and attributes: only it changes this filesystem

MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


class Node:
    __slots__ = ("data", "dirty", "durable", "durable_entries", "entries", "ino", "is_dir", "mtime")

    def __init__(self, ino: int, is_dir: bool) -> None:
        self.ino = ino
        self.is_dir = is_dir
        self.data = bytearray()  # what processes see
        self.durable = bytearray()  # what survives a crash
        self.dirty: set[int] = set()  # pages written since the last fsync
        self.entries: dict[str, int] = {}
        self.durable_entries: dict[str, int] = {}
        self.mtime = time.time_ns()

    def mark(self, start: int, end: int) -> None:
        self.dirty.update(range(start // PAGE, (end + PAGE - 1) // PAGE))

    def resize(self, size: int) -> None:
        old = len(self.data)
        if size > old:
            self.data.extend(bytes(size - old))
        else:
            del self.data[size:]
        self.mark(min(old, size), max(old, size))

    def sync(self) -> None:
        size = len(self.data)
        if len(self.durable) < size:
            self.durable.extend(bytes(size - len(self.durable)))
        else:
            del self.durable[size:]
        for page in self.dirty:
            lo = page * PAGE
            self.durable[lo : lo + PAGE] = self.data[lo : lo + PAGE]
        self.dirty.clear()

    def land_some(self, rng: random.Random) -> int:
        """Pages written since the last fsync reach the disk whole, not at all, or up to a
        sector boundary (a torn page); returns how many landed whole or in part."""
        landed = 0
        for page in sorted(self.dirty):
            new = self.data[page * PAGE : (page + 1) * PAGE]
            fate = rng.randrange(3)
            if not new or fate == 0:
                continue
            cut = len(new) if fate == 1 else min(len(new), rng.randrange(1, PAGE // 512) * 512)
            end = page * PAGE + cut
            if len(self.durable) < end:
                self.durable.extend(bytes(end - len(self.durable)))
            self.durable[page * PAGE : end] = new[:cut]
            landed += 1
        return landed


class PowerLossFS:
    def __init__(self, durable_dir: Path) -> None:
        self.durable_dir = durable_dir
        self.nodes: dict[int, Node] = {}
        self.next_ino = 2
        self.lock = threading.Lock()
        self.crashed = False
        self.fail_next_fsync: int | None = None  # a file size
        self.fail_next_write: int | None = None  # a file size
        self.fail_lseek: int | None = None  # a file size
        self.writes_failed = 0
        self.fsyncs = 0
        self.dir_fsyncs = 0
        root = Node(1, True)
        self.nodes[1] = root
        if durable_dir.exists():
            self._load(root, durable_dir)

    def _new(self, is_dir: bool) -> Node:
        node = Node(self.next_ino, is_dir)
        self.next_ino += 1
        self.nodes[node.ino] = node
        return node

    def _load(self, into: Node, path: Path) -> None:
        for child in sorted(path.iterdir()):
            node = self._new(child.is_dir())
            if node.is_dir:
                self._load(node, child)
            else:
                node.data = bytearray(child.read_bytes())
                node.durable = bytearray(node.data)
            into.entries[child.name] = node.ino
        into.durable_entries = dict(into.entries)

    def dump(self) -> tuple[int, int]:
        """Write the durable state to ``durable_dir``; returns (files, directories)."""
        tmp = self.durable_dir.with_name(self.durable_dir.name + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        counts = [0, 0]

        def write(node: Node, path: Path) -> None:
            path.mkdir()
            counts[1] += 1
            for name, ino in node.durable_entries.items():
                child = self.nodes[ino]
                if child.is_dir:
                    write(child, path / name)
                else:
                    (path / name).write_bytes(bytes(child.durable))
                    counts[0] += 1

        write(self.nodes[1], tmp)
        shutil.rmtree(self.durable_dir, ignore_errors=True)
        tmp.rename(self.durable_dir)
        return counts[0], counts[1]

    # -- replies -------------------------------------------------------------------------------

    def attr(self, node: Node) -> bytes:
        size = len(node.data)
        mode = (stat.S_IFDIR | 0o755) if node.is_dir else (stat.S_IFREG | 0o644)
        sec, nsec = divmod(node.mtime, 1_000_000_000)
        return ATTR.pack(
            node.ino,
            size,
            (size + 511) // 512,
            sec,
            sec,
            sec,
            nsec,
            nsec,
            nsec,
            mode,
            2 if node.is_dir else 1,
            0,
            0,
            0,
            PAGE,
            0,
        )

    def entry(self, node: Node) -> bytes:
        return ENTRY_OUT.pack(node.ino, 0, VALID_S, VALID_S, 0, 0) + self.attr(node)

    # -- requests ------------------------------------------------------------------------------

    def handle(self, opcode: int, nodeid: int, body: bytes) -> bytes | int:
        """The reply body, or a positive errno."""
        if opcode == INIT:
            _major, _minor, readahead, _flags = struct.unpack_from("<IIII", body)
            return INIT_OUT.pack(
                7, 31, readahead, FUSE_BIG_WRITES, 16, 12, MAX_WRITE, 1, 32, 0, 0, *[0] * 7
            )
        node = self.nodes.get(nodeid)
        if node is None:
            return errno.ENOENT
        mutating = opcode in (
            SETATTR,
            MKNOD,
            MKDIR,
            UNLINK,
            RMDIR,
            RENAME,
            RENAME2,
            LINK,
            WRITE,
            FSYNC,
            FSYNCDIR,
            CREATE,
            FALLOCATE,
        )
        if mutating and self.crashed:
            return errno.EIO
        if opcode == LOOKUP:
            ino = node.entries.get(_name(body))
            return errno.ENOENT if ino is None else self.entry(self.nodes[ino])
        if opcode == GETATTR:
            return ATTR_OUT.pack(VALID_S, 0, 0) + self.attr(node)
        if opcode == SETATTR:
            valid, *_rest = SETATTR_IN.unpack_from(body)
            if valid & FATTR_SIZE:
                if node.is_dir:
                    return errno.EISDIR
                node.resize(SETATTR_IN.unpack_from(body)[3])
            if valid & (FATTR_SIZE | FATTR_MTIME):
                node.mtime = time.time_ns()
            return ATTR_OUT.pack(VALID_S, 0, 0) + self.attr(node)
        if opcode in (OPEN, OPENDIR):
            return OPEN_OUT.pack(0, FOPEN_KEEP_CACHE if opcode == OPEN else 0, 0)
        if opcode in (RELEASE, RELEASEDIR, FLUSH, ACCESS, DESTROY):
            return b""
        if opcode == READ:
            _fh, offset, size, *_ = READ_IN.unpack_from(body)
            return bytes(node.data[offset : offset + size])
        if opcode == WRITE:
            _fh, offset, size, write_flags, *_ = WRITE_IN.unpack_from(body)
            if self.fail_next_write == len(node.data) and not write_flags & FUSE_WRITE_CACHE:
                self.fail_next_write = None
                self.writes_failed += 1
                return errno.EIO
            data = body[WRITE_IN.size : WRITE_IN.size + size]
            end = offset + len(data)
            if end > len(node.data):
                node.resize(end)
            node.data[offset:end] = data
            node.mark(offset, end)
            node.mtime = time.time_ns()
            return struct.pack("<II", len(data), 0)
        if opcode == FALLOCATE:
            _fh, offset, length, mode, _ = FALLOCATE_IN.unpack_from(body)
            if mode not in (0, 1):  # 1: FALLOC_FL_KEEP_SIZE
                return errno.EOPNOTSUPP
            if mode == 0 and offset + length > len(node.data):
                node.resize(offset + length)
            return b""
        if opcode == LSEEK:
            # The extent map of a file with no holes (what the kernel's generic lseek answers
            # when a filesystem has none); ``fail-lseek`` makes it fail as a disk that cannot
            # read a file's extent tree does. Answered, not ENOSYS: that would make the kernel
            # stop asking for the mount's lifetime.
            _fh, offset, whence, _ = LSEEK_IN.unpack_from(body)
            if self.fail_lseek == len(node.data):
                return errno.EIO
            if whence not in (SEEK_DATA, SEEK_HOLE):
                return errno.EINVAL
            if offset >= len(node.data):
                return errno.ENXIO
            return struct.pack("<Q", offset if whence == SEEK_DATA else len(node.data))
        if opcode == FSYNC:
            if self.fail_next_fsync == len(node.data):
                self.fail_next_fsync = None
                node.dirty.clear()
                return errno.EIO
            node.sync()
            self.fsyncs += 1
            return b""
        if opcode == FSYNCDIR:
            node.durable_entries = dict(node.entries)
            self.dir_fsyncs += 1
            return b""
        if opcode == STATFS:
            return STATFS_OUT.pack(
                1 << 24, 1 << 23, 1 << 23, 1 << 20, 1 << 19, PAGE, 255, PAGE, 0, *[0] * 6
            )
        if opcode in (CREATE, MKNOD, MKDIR):
            head = {CREATE: 16, MKNOD: 16, MKDIR: 8}[opcode]
            name = _name(body[head:])
            if name in node.entries:
                return errno.EEXIST
            child = self._new(opcode == MKDIR)
            node.entries[name] = child.ino
            node.mtime = time.time_ns()
            if opcode == CREATE:
                return self.entry(child) + OPEN_OUT.pack(0, FOPEN_KEEP_CACHE, 0)
            return self.entry(child)
        if opcode in (UNLINK, RMDIR):
            name = _name(body)
            ino = node.entries.get(name)
            if ino is None:
                return errno.ENOENT
            target = self.nodes[ino]
            if opcode == RMDIR and target.entries:
                return errno.ENOTEMPTY
            del node.entries[name]
            return b""
        if opcode == LINK:
            # A hard link (the file:// tier's create-if-absent): a new name, in this
            # directory, for an existing file; durable once this directory is fsynced.
            (oldnode,) = struct.unpack_from("<Q", body)
            name = _name(body[8:])
            target = self.nodes.get(oldnode)
            if target is None:
                return errno.ENOENT
            if target.is_dir:
                return errno.EPERM
            if name in node.entries:
                return errno.EEXIST
            node.entries[name] = target.ino
            node.mtime = time.time_ns()
            return self.entry(target)
        if opcode in (RENAME, RENAME2):
            head = 8 if opcode == RENAME else 16
            (newdir,) = struct.unpack_from("<Q", body)
            flags = struct.unpack_from("<I", body, 8)[0] if opcode == RENAME2 else 0
            old, new = body[head:].split(b"\0")[:2]
            old_name, new_name = old.decode(), new.decode()
            dest = self.nodes[newdir]
            ino = node.entries.get(old_name)
            if ino is None:
                return errno.ENOENT
            if flags & ~1:
                return errno.EINVAL
            existing = dest.entries.get(new_name)
            if existing is not None:
                if flags & 1:
                    return errno.EEXIST
                if self.nodes[existing].is_dir and self.nodes[existing].entries:
                    return errno.ENOTEMPTY
            del node.entries[old_name]
            dest.entries[new_name] = ino
            return b""
        if opcode == READDIR:
            _fh, offset, size, *_ = READ_IN.unpack_from(body)
            listing = [(".", node.ino, True), ("..", 1, True)] + [
                (n, i, self.nodes[i].is_dir) for n, i in node.entries.items()
            ]
            out = bytearray()
            for index in range(offset, len(listing)):
                name, ino, is_dir = listing[index]
                raw = name.encode()
                rec = DIRENT.pack(ino, index + 1, len(raw), 4 if is_dir else 8) + raw
                rec += bytes(-len(rec) % 8)
                if len(out) + len(rec) > size:
                    break
                out += rec
            return bytes(out)
        return errno.ENOSYS


def _name(body: bytes) -> str:
    return body.split(b"\0", 1)[0].decode()


def mount(mountpoint: Path) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if (
        libc.mount(
            b"tmq-powerloss",
            str(mountpoint).encode(),
            b"fuse.tmq-powerloss",
            MS_NOSUID | MS_NODEV,
            options,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")
    return fd


def unmount(mountpoint: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(str(mountpoint).encode(), MNT_DETACH)


def serve(fs: PowerLossFS, fd: int) -> None:
    while True:
        try:
            request = os.read(fd, MAX_WRITE + 64 * 1024)
        except OSError as e:
            if e.errno == errno.EINTR or e.errno == errno.ENOENT:
                continue
            return  # ENODEV: unmounted
        if not request:
            return
        _len, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(request)
        body = request[IN_HEADER.size :]
        if opcode == BATCH_FORGET or opcode in NO_REPLY:
            continue
        with fs.lock:
            try:
                result = fs.handle(opcode, nodeid, body)
            except Exception as e:  # a bug here must not hang the test: answer EIO and say why
                print(f"powerloss_fs: opcode {opcode}: {e!r}", file=sys.stderr, flush=True)
                result = errno.EIO
        if isinstance(result, int):
            reply = OUT_HEADER.pack(OUT_HEADER.size, -result, unique)
        else:
            reply = OUT_HEADER.pack(OUT_HEADER.size + len(result), 0, unique) + result
        with contextlib.suppress(OSError):  # an interrupted request: nobody waits for it
            os.write(fd, reply)


def main() -> None:
    mountpoint, durable_dir = Path(sys.argv[1]), Path(sys.argv[2])
    fs = PowerLossFS(durable_dir)
    mountpoint.mkdir(parents=True, exist_ok=True)
    fd = mount(mountpoint)
    threading.Thread(target=serve, args=(fs, fd), daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "crash" or command.startswith("crash "):
            with fs.lock:
                fs.crashed = True
                landed = ""
                if command != "crash":
                    rng = random.Random(command.split()[1])
                    nodes = [fs.nodes[ino] for ino in sorted(fs.nodes)]
                    landed = f" {sum(n.land_some(rng) for n in nodes if not n.is_dir)}"
                files, dirs = fs.dump()
            print(f"crashed {files} {dirs}{landed}", flush=True)
        elif command.startswith("fail-fsync "):
            with fs.lock:
                fs.fail_next_fsync = int(command.split()[1])
            print("armed", flush=True)
        elif command.startswith("fail-lseek "):
            with fs.lock:
                fs.fail_lseek = int(command.split()[1])
            print("armed", flush=True)
        elif command.startswith("fail-write "):
            with fs.lock:
                fs.fail_next_write = int(command.split()[1])
            print("armed", flush=True)
        elif command == "stats":
            print(f"stats {fs.fsyncs} {fs.dir_fsyncs} {fs.writes_failed}", flush=True)
        elif command == "exit":
            break
    unmount(mountpoint)
    os._exit(0)


if __name__ == "__main__":
    main()
