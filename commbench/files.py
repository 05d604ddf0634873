"""Files the user names: reading an input (a spec, a latency table, a snapshot, nccl-tests
output) and checking an output (--json, --junit, --plot, --out) before the command does its work.

Whatever is wrong with one (a directory, missing, unreadable, binary, not UTF-8, not writable)
is bad input: one line naming the file, never a traceback, and nothing written.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, TextIO

from commbench.errors import UsageError

STDOUT = "-"   # --json - writes to standard output


# Inputs are read whole: more than this is no file commbench reads (and /dev/zero never ends).
MAX_INPUT_BYTES = 1 << 30


class NoSuchFile(UsageError):
    """The input is not there: a reader for which a missing file is an answer (an engine release
    without that module) catches this, and every other refusal stays bad input."""


def open_input(path: Path, what: str) -> BinaryIO:
    """`path` opened for reading when it is a regular file. A directory, a FIFO, a socket or a
    device is refused with one line: a FIFO would block the open (and the read) forever, a
    device such as /dev/zero never ends. Opened without blocking, then checked: no race
    between the check and the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NoSuchFile(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise UsageError(f"{path}: is {kind}, not {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_input(path: Path, what: str) -> None:
    """Refuse `path` as open_input would, for a reader that opens it itself (sqlite)."""
    open_input(path, what).close()


def _read(handle: BinaryIO, path: Path, size: int) -> bytes:
    try:
        return handle.read(size)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None


def _decoded(data: bytes, path: Path, what: str, offset: int = 0) -> str:
    if b"\0" in data:
        raise UsageError(f"{path}: binary file, not {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {offset + exc.start}), not {what}") from None


def read_text(path: Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The file's text; `what` names what it should hold ("a qualify spec"); a file larger
    than max_bytes is refused."""
    with open_input(path, what) as handle:
        data = _read(handle, path, max_bytes + 1)
    if len(data) > max_bytes:
        raise UsageError(f"{path}: larger than {max_bytes >> 20} MiB, not {what}")
    return _decoded(data, path, what)


_LINE_BLOCK_BYTES = 1 << 16   # lines are read this much at a time: a few hundred lines held


def read_lines(path: Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> Iterator[str]:
    """The file's lines as str.splitlines() gives them, streamed (a large log is never held
    whole), with read_text's checks; a binary or non-UTF-8 line is refused when it is reached.
    Read a block of whole lines at a time (a line at a time cost ~2 µs a line: a third of
    reading a 10^6-line log)."""
    with open_input(path, what) as handle:
        offset, rest = 0, b""
        while True:
            block = _read(handle, path, _LINE_BLOCK_BYTES)
            if offset + len(rest) + len(block) > max_bytes:
                raise UsageError(f"{path}: larger than {max_bytes >> 20} MiB, not {what}")
            if not block:
                if rest:
                    yield from _block_lines(rest, path, what, offset)
                return
            end = block.rfind(b"\n") + 1
            if not end:
                rest += block   # a line longer than a block (bounded by max_bytes, as read_text is)
                continue
            whole, rest = rest + block[:end], block[end:]
            yield from _block_lines(whole, path, what, offset)
            offset += len(whole)


def byte_blocks(path: Path, what: str, block_bytes: int = _LINE_BLOCK_BYTES,
                max_bytes: int = MAX_INPUT_BYTES) -> Iterator[bytes]:
    """The file's bytes a block at a time, a regular file only (open_input), refused once more
    than max_bytes have been read: bounded by what is read, not by st_size (a symlink to
    /dev/zero says 0)."""
    with open_input(path, what) as handle:
        offset = 0
        while block := _read(handle, path, block_bytes):
            if offset + len(block) > max_bytes:
                raise UsageError(f"{path}: larger than {max_bytes >> 20} MiB, not {what}")
            yield block
            offset += len(block)


def text_blocks(path: Path, what: str, block_bytes: int = _LINE_BLOCK_BYTES,
                max_bytes: int = MAX_INPUT_BYTES) -> Iterator[str]:
    """The file's text a block at a time (a character cut by a block's end comes with the next),
    with read_text's checks, each made when its block is reached."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for block in byte_blocks(path, what, block_bytes, max_bytes):
        if b"\0" in block:
            _decoded(block, path, what)   # raises: a binary file
        try:
            yield decoder.decode(block)
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path}: not UTF-8 text (byte {offset + exc.start}), not {what}") from None
        offset += len(block)
    pending = len(decoder.getstate()[0])   # a character the file ends inside of
    if pending:
        raise UsageError(f"{path}: not UTF-8 text (byte {offset - pending}), not {what}")


def first_character(path: Path, what: str) -> str:
    """The file's first character that is not white space ('' when there is none), read a block
    at a time (a -J JSON file is one line of up to MAX_INPUT_BYTES)."""
    for text in text_blocks(path, what):
        if text.strip():
            return text.lstrip()[0]
    return ""


def _block_lines(block: bytes, path: Path, what: str, offset: int) -> list[str] | Iterator[str]:
    """The lines of a block that ends a line; one with a bad byte is read a line at a time, so
    that every line before the bad one comes first."""
    if b"\0" not in block:
        try:
            return block.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            pass
    return _lines_one_by_one(block, path, what, offset)


def _lines_one_by_one(block: bytes, path: Path, what: str, offset: int) -> Iterator[str]:
    for piece in block.splitlines(keepends=True):   # \r and \n are never inside a UTF-8 character
        yield from _decoded(piece, path, what, offset).splitlines()
        offset += len(piece)


def check_file_target(target: str | Path | None, flag: str) -> None:
    """Fail early when `flag` names something that cannot become a file ('-' is stdout)."""
    if target is None or str(target) == STDOUT:
        return
    path = Path(target)
    if path.is_dir():
        raise UsageError(f"{flag} {target}: is a directory (give a file name)")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {target}: no such directory {path.parent}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {target}: not writable (permission denied)")
    _check_writable_folder(path.parent, f"{flag} {target}")


def check_dir_target(path: Path, what: str) -> None:
    """Fail early when nothing could be written under `path` (created later, as needed);
    `what` names it in the message ("--out results")."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what}: exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    _check_writable_folder(existing, what)


def output_folder(given: Path | None, name: str, inputs: list[Path]) -> Path:
    """Where an analysis command writes: --out, else ./NAME. Analysis reads its input run dirs
    and never writes into one, so a default that would land inside one is refused."""
    if given is not None:
        check_dir_target(given, f"--out {given}")
        return given
    out = Path.cwd() / name
    for folder in inputs:
        if out.resolve().is_relative_to(folder.resolve()):
            raise UsageError(f"{out} would be inside the input run dir {folder}: run from another directory or "
                             "pass --out DIR")
    check_dir_target(out, f"{out} (the default; --out DIR writes elsewhere)")
    return out


def _check_writable_folder(folder: Path, what: str) -> None:
    # Root ignores mode bits, so only a real write tells (a read-only mount, /proc).
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"{what}: not writable ({exc.strerror})") from None


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError of a write to `path` names it: a failed write() (a full disk) carries no file
    name, and its one line would say only "No space left on device"."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
        raise


# While json_alone_on_stdout() holds: the real standard output, where `--json -` writes.
_json_stream: TextIO | None = None


@contextmanager
def json_alone_on_stdout(target: str | None) -> Iterator[None]:
    """With `--json -`, standard output carries the JSON alone (a pipe into a JSON reader):
    everything the command prints meanwhile goes to standard error."""
    global _json_stream
    if target != STDOUT:
        yield
        return
    _json_stream = sys.stdout
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stream = None


def write_json(target: str | None, payload: Any, default: Callable[[Any], Any] = str) -> None:
    """Write payload to the --json target (checked before with check_file_target); `default`
    encodes what json cannot (json.dumps' own hook). Nothing is encoded without a target, and
    the text is written as json encodes it, a piece at a time (json.dumps' text, never held whole;
    a LazyList in the payload is encoded an item at a time)."""
    if target is None:
        return
    pieces = json.JSONEncoder(indent=2, default=default).iterencode(payload)   # indent: json's Python encoder
    _write_pieces(target, itertools.chain(pieces, ["\n"]))


class LazyList(list):  # type: ignore[type-arg]
    """A list for files.write_json whose items are made as they are written: `count` items from
    `items()`, each dropped once encoded (attribute's every step and call of 10^6-call traces as
    dicts took gigabytes). json's Python encoder (write_json: indent) iterates it; anything that
    copies it (dataclasses.asdict, for an HTML page that holds every item anyway) gets a list of
    them. Given a plain iterable instead, it is that list."""

    def __init__(self, items: Iterable[Any] = (), count: int | None = None,
                 make: Callable[[], Iterator[Any]] | None = None):
        super().__init__(() if make is not None else items)
        self._count, self._make = count, make

    def __iter__(self) -> Iterator[Any]:
        return self._make() if self._make is not None else super().__iter__()

    def __len__(self) -> int:
        return self._count if self._make is not None else super().__len__()   # type: ignore[return-value]


def write_json_list(target: str | None, payload: dict[str, Any], key: str, items: Iterator[Any],
                    default: Callable[[Any], Any] = str) -> None:
    """write_json of payload with payload[key] = the items, the same text, written an item at a
    time: a list of 10^5 dicts and its text are never held (payload[key] itself is ignored)."""
    first = next(items, _NOTHING)
    if first is _NOTHING:
        return write_json(target, {**payload, key: []}, default)
    head, _, tail = json.dumps({**payload, key: [_NOTHING]}, indent=2, default=default).partition('"' + _NOTHING + '"')

    def pieces() -> Iterator[str]:
        yield head   # ends where the first item starts, at its list's indent
        for i, item in enumerate(itertools.chain([first], items)):
            text = json.dumps(item, indent=2, default=default).replace("\n", "\n" + _ITEM_INDENT)
            yield text if i == 0 else ",\n" + _ITEM_INDENT + text
        yield tail + "\n"
    _write_pieces(target, pieces())


_NOTHING = "@commbench:no-item@"   # a sentinel: JSON writes it as it is, and no payload holds it
_ITEM_INDENT = " " * 4                     # a top-level key's list items: two levels of indent=2


def _write_pieces(target: str | None, pieces: Iterable[str]) -> None:
    if target is None:
        return
    if target == STDOUT:
        stream = _json_stream or sys.stdout
        for piece in pieces:
            stream.write(piece)
        return
    # A full disk is the machine's, not bad input: the command could not finish (exit 1), the
    # file named (a failed write() names none).
    with naming(target), open(target, "w", encoding="utf-8") as handle:
        for piece in pieces:
            handle.write(piece)


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A folder to fill beside `out`, moved into `out` when the block ends and removed, with any
    parent folder made for it, when the block raises: a command that fails leaves nothing behind.
    Where `out` does not exist the folder is renamed into place; where it does (an --out named
    again), each file written replaces its namesake there, and a symlink where a file would go is
    refused before anything moves (commbench writes only its own files)."""
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    try:   # an OSError names its folder: the command says it in one line (make it writable)
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError:
        _discard(None, made)
        raise
    try:
        yield work
        _check_moves(work, out)
    except BaseException:
        _discard(work, made)
        raise
    _move_into(work, out)


def _check_moves(src: Path, dst: Path) -> None:
    if not dst.exists() and not dst.is_symlink():
        return
    if dst.is_symlink() or not dst.is_dir():
        raise UsageError(f"{dst}: {'a symlink' if dst.is_symlink() else 'not a directory'}; commbench writes only "
                         "its own files there")
    for entry in src.iterdir():
        target = dst / entry.name
        if target.is_symlink():
            raise UsageError(f"{target}: a symlink; commbench writes only its own files there")
        if entry.is_dir():
            _check_moves(entry, target)
        elif target.is_dir():
            raise UsageError(f"{target}: a directory where commbench writes a file")


def _move_into(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.replace(src, dst)
        return
    for entry in src.iterdir():
        target = dst / entry.name
        if entry.is_dir() and target.is_dir():
            _move_into(entry, target)
        else:
            os.replace(entry, target)
    src.rmdir()


def _discard(work: Path | None, made: list[Path]) -> None:
    """The staged folder, and the parents made for it (innermost first) where nothing else is in them."""
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break
