"""artemis.conf's syntax: ``Key=Value`` lines, ``Include``, and the check that a file only root
or the daemon's user could have written.  What the keys mean lives in ``artemisd.config``."""

from __future__ import annotations

import glob
import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path

MAX_INCLUDE_DEPTH = 8


class ConfigError(ValueError):
    """A problem in artemis.conf; ``file``, ``line`` and ``key`` point at it."""

    def __init__(self, file: str | Path, line: int | None, key: str | None, reason: str):
        self.file = str(file)
        self.line = line
        self.key = key
        self.reason = reason
        where = f"{self.file}:{line}" if line else self.file
        super().__init__(f"{where}: {key}: {reason}" if key else f"{where}: {reason}")


@dataclass(frozen=True)
class Setting:
    """One ``Key=Value`` as written, with where it was written."""

    key: str
    value: str
    file: str
    line: int


@dataclass
class ConfLine:
    settings: list[Setting] = field(default_factory=list)


def split_pairs(text: str, file: str, number: int) -> list[Setting]:
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError as err:  # unbalanced quotes
        raise ConfigError(file, number, None, f"cannot parse line: {err}") from None
    pairs: list[Setting] = []
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep or not key:
            raise ConfigError(file, number, token, "expected Key=Value")
        pairs.append(Setting(key, value, file, number))
    return pairs


def check_config_file_secure(path: str | Path, euid: int | None = None, st: os.stat_result | None = None) -> None:
    """Refuse (``ConfigError`` naming ``path``) a file that someone other than root or ``euid``
    (default: this process's) could have written or replaced.

    The file must not be group- or world-writable and must be owned by root or
    ``euid``; its directory (and, for a symbolic link, the directory of the file
    it reaches) must not be group- or world-writable unless sticky, nor owned by
    another user: whoever may write a directory may rename the file away and put
    their own in its place.  ``st``: the file's ``fstat``, where the caller holds
    it open, so that the file checked is the file read.
    """
    path = Path(path)
    euid = os.geteuid() if euid is None else euid
    trusted = (0, euid)
    if st is None:
        try:
            st = os.stat(path)
        except OSError as err:
            raise ConfigError(path, None, None, f"cannot read: {err.strerror}") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ConfigError(path, None, None, f"mode {mode:04o} lets group or others write it: chmod go-w it "
                                            f"(artemisd refuses a configuration others could change)")
    if st.st_uid not in trusted:
        raise ConfigError(path, None, None, f"owned by uid {st.st_uid}, neither root nor the daemon's user "
                                            f"(uid {euid}), who could change it: chown it to root")
    directories = [path.absolute().parent]
    resolved = Path(os.path.realpath(path)).parent
    if resolved != directories[0]:
        directories.append(resolved)
    for directory in directories:
        try:
            dst = os.stat(directory)
        except OSError as err:
            raise ConfigError(path, None, None, f"cannot read its directory {directory}: {err.strerror}") from None
        dmode = stat.S_IMODE(dst.st_mode)
        if dmode & 0o022 and not dmode & stat.S_ISVTX:
            raise ConfigError(path, None, None, f"its directory {directory} (mode {dmode:04o}) lets group or others "
                                                f"replace it: chmod go-w the directory")
        if dst.st_uid not in trusted:
            raise ConfigError(path, None, None, f"its directory {directory} is owned by uid {dst.st_uid}, neither "
                                                f"root nor the daemon's user (uid {euid}), who could replace it")


def read_lines(path: str | Path, _depth: int = 0, *, secure: bool = False) -> list[ConfLine]:
    """Tokenise a file and its Includes into lines of settings, in order; ``secure``: each file
    must pass ``check_config_file_secure`` first."""
    path = Path(path)
    if _depth > MAX_INCLUDE_DEPTH:
        raise ConfigError(path, None, "Include", f"nested deeper than {MAX_INCLUDE_DEPTH} (a loop?)")
    try:
        with open(path, encoding="utf-8") as f:
            if secure:
                check_config_file_secure(path, st=os.fstat(f.fileno()))
            text = f.read()
    except OSError as err:
        raise ConfigError(path, None, None, f"cannot read: {err.strerror}") from None
    lines: list[ConfLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        head = stripped.split(None, 1)
        if head[0].lower() == "include" or head[0].lower().startswith("include="):
            target = stripped[len("include"):].lstrip(" =\t").strip().strip('"')
            if not target:
                raise ConfigError(path, number, "Include", "needs a path")
            pattern = target if Path(target).is_absolute() else str(path.parent / target)
            matches = sorted(glob.glob(pattern))
            if not matches and not glob.has_magic(pattern):
                raise ConfigError(path, number, "Include", f"{pattern}: no such file")
            for match in matches:
                lines.extend(read_lines(match, _depth + 1, secure=secure))
            continue
        lines.append(ConfLine(split_pairs(stripped, str(path), number)))
    return lines
