"""Where files enter and leave: input files are read only when they are regular files of bounded
size (a FIFO or a link to /dev/zero would block or grow for ever); outputs are written atomically, so a
stage never leaves a half-written file behind, and never through a symlink or onto a device."""
from __future__ import annotations

import errno
import functools
import json
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

# A file name's longest length on the file systems this runs on (NAME_MAX of ext4, xfs, btrfs, tmpfs).
MAX_NAME_BYTES = 255
# How deep a JSON document may nest: every document the project reads is at most 4 levels deep, and
# Python's parser recurses once per level (a deep one would end in RecursionError).
MAX_JSON_DEPTH = 32
# A result file --save-result replaces or --append-result adds to: with --save-detailed a run holds its per-request lists, a
# few hundred bytes per request, so a million-request run's file stays far below this.
MAX_RESULT_BYTES = 1 << 30
# The keys every vLLM result file holds (vllm/benchmarks/serve.py, benchmark_serving.py before it), and
# so every line servingplan.cli.vllm_result writes
RESULT_FILE_KEYS = ("date", "request_rate")


class InputError(ValueError):
    """An input or output path that cannot be used; its message is one line naming the path."""


def read_input(path, what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` (`what` names it in errors: "trace", "cost model", ...).
    Its kind is checked with os.stat before it is opened, and it is opened non-blocking and checked
    again, so a FIFO, a device (a link to /dev/zero), a directory or a file over `max_bytes` is
    refused with one line instead of blocking, growing or reading gigabytes."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise InputError(f"{what} {str(path)!r}: cannot be read ({exc.strerror or exc})") from None
    _require_regular(path, what, info, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InputError(f"{what} {str(path)!r}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as handle:
        # the path may have been swapped between stat and open: what was opened is what counts
        _require_regular(path, what, os.fstat(fd), max_bytes)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"{what} {str(path)!r}: larger than {max_bytes:,} bytes")
    return data


def _require_regular(path, what: str, info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{what} {str(path)!r}: is {_kind(info.st_mode)}, must be a regular file")
    if info.st_size > max_bytes:
        raise InputError(f"{what} {str(path)!r}: {info.st_size:,} bytes, at most {max_bytes:,} allowed")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def read_text_input(path, what: str, max_bytes: int) -> str:
    """read_input decoded as UTF-8; a file in another encoding is refused with one line."""
    data = read_input(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {str(path)!r}: not UTF-8 text (byte {exc.start}: {data[exc.start]:#04x})") from None


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _unique_keys(pairs):
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise ValueError(f"key {key!r} appears twice in one object")
    return dict(pairs)


def parse_json(text: str, what: str):
    """A JSON document with at most MAX_JSON_DEPTH levels and no key given twice in one object
    (json.loads would keep the last silently); ValueError with one line otherwise. NaN and Infinity
    are read as floats, so the check of the field that holds one can name it."""
    # counting brackets first keeps the character scan off the long, flat lines of a JSONL trace
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{what}: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise ValueError(f"{what}: not a JSON document ({' '.join(str(exc).split())})") from None


def check_output_path(directory, filename: str, what: str, directory_what: str = "result directory") -> Path:
    """The path `filename` names inside the existing, writable `directory`, checked before any work:
    a plain file name (no folder part, so the file stays in its folder), at most MAX_NAME_BYTES long,
    and, if the file exists, a regular file (never a symlink or a device, which a write would replace
    or write through) holding results (check_result_lines): a trace or a cost model given by mistake
    would be replaced, or corrupted by the line --append-result adds."""
    directory = Path(directory)
    if not filename or filename in (".", "..") or "/" in filename or "\0" in filename:
        raise InputError(f"{what} {filename!r}: must be a plain file name inside the result directory "
                         "(no '/' or '..')")
    if len(os.fsencode(filename)) > MAX_NAME_BYTES:
        raise InputError(f"{what} {filename[:40]!r}...: {len(os.fsencode(filename))} bytes long, at most "
                         f"{MAX_NAME_BYTES} allowed")
    if not directory.is_dir():
        raise InputError(f"{directory_what} {str(directory)!r}: "
                         f"{'not a directory' if directory.exists() else 'no such directory'}")
    _check_writable(directory, directory_what)
    path = directory / filename
    _check_replaceable(path, what)
    if os.path.lexists(path):
        check_result_lines(path, what)
    return path


def _check_writable(directory: Path, what: str) -> None:
    """A file can be created in `directory`: tried, since os.access says yes to root everywhere, even
    where no file can be made (/proc, a read-only mount)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"{what} {str(directory)!r}: not writable")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-check-", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"{what} {str(directory)!r}: no file can be created there ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def check_result_lines(path, what: str) -> int:
    """The number of results in the existing file `path`, which --save-result replaces and
    --append-result adds a line to: read as a regular UTF-8 file of at most MAX_RESULT_BYTES whose
    every non-blank line is a JSON object holding RESULT_FILE_KEYS (NaN allowed: vLLM's json.dump
    writes it for an undefined figure). Anything else (a trace, a cost model, a binary file) is
    refused with one line before any run, instead of being replaced or having a line added to it."""
    try:
        text = read_text_input(path, what, MAX_RESULT_BYTES)
    except InputError as exc:
        raise InputError(f"{exc}; only a result file is replaced or appended to") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    for number, line in lines:
        try:
            result = parse_json(line, f"line {number}")
        except ValueError as exc:
            raise InputError(f"{what} {str(path)!r}: exists and is not a vLLM result file ({exc}); only a result "
                             "file is replaced or appended to") from None
        if not isinstance(result, dict) or not set(RESULT_FILE_KEYS) <= set(result):
            raise InputError(f"{what} {str(path)!r}: exists and is not a vLLM result file (line {number} is no JSON "
                             f"object with {', '.join(RESULT_FILE_KEYS)}); only a result file is replaced or "
                             "appended to")
    return len(lines)


def _check_replaceable(path: Path, what: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{what} {str(path)!r}: exists and is {_kind(info.st_mode)}; only a regular file is "
                         "replaced")


def quiet_on_closed_pipe(main):
    """An entry point whose reader went away (`... | head -1`) ends quietly instead of with a
    BrokenPipeError traceback; the exit code is the shell's for SIGPIPE (141)."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 128 + 13
    return wrapper


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_replaceable(path, "output")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file private (0600); give it the mode a plain open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _json_default(o):
    import numpy as np
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(path, data) -> None:
    """`data` as JSON; NaN or infinity anywhere raises ValueError (JSON has neither: a writer must
    turn an undefined figure into null, never write `NaN` or `Infinity`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default, allow_nan=False) + "\n")


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_csv(path, frame) -> None:
    """Write a pandas DataFrame; floats keep full precision so reruns compare byte for byte."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, lineterminator="\n")


def read_json(path):
    return json.loads(Path(path).read_text())
