"""artemis.conf: slurm.conf-style configuration.

Syntax (as slurm.conf(5)): one or more ``Key=Value`` pairs per line, keys are
case-insensitive, ``#`` starts a comment outside quotes, values with spaces are
double-quoted, ``Include PATH`` (or ``Include=PATH``; globs allowed, relative to
the including file) reads another file in place.  Lines whose first key is a
*block key* (``PartitionPolicy=gpu …``) open a record of their own; see
``BLOCK_KEYS``.

Every unknown key and every bad value raises ``ConfigError`` naming the file,
line and key.  The schema lives in pydantic models; ``KEYS`` maps each
``artemis.conf`` key to the model field it sets, so there is exactly one table
to extend when a key is added (and docs/artemis.conf.5.md documents each).
"""

from __future__ import annotations

import glob
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


def _split_pairs(text: str, file: str, number: int) -> list[Setting]:
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


def read_lines(path: str | Path, _depth: int = 0) -> list[ConfLine]:
    """Tokenise a file and its Includes into lines of settings, in order."""
    path = Path(path)
    if _depth > MAX_INCLUDE_DEPTH:
        raise ConfigError(path, None, "Include", f"nested deeper than {MAX_INCLUDE_DEPTH} (a loop?)")
    try:
        text = path.read_text(encoding="utf-8")
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
                lines.extend(read_lines(match, _depth + 1))
            continue
        lines.append(ConfLine(_split_pairs(stripped, str(path), number)))
    return lines


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("yes", "true", "on", "1"):
        return True
    if lowered in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"expected yes/no, got {value!r}")


# --- schema ---------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AnalysisSettings(_Section):
    """Detection and confirmation thresholds (docs/artemis.conf.5.md, "Analysis").

    A rank is *flagged* in a window when its busy time exceeds the median busy of
    its island peers by at least ``min_slowdown`` (relative) **and** by at least
    ``robust_z`` robust standard deviations (1.4826 x MAD of the peers).  A flag
    becomes an incident after ``confirm_windows`` consecutive flagged windows
    under matched conditions.
    """

    window_steps: int = Field(default=50, ge=1, le=100_000)
    min_slowdown: float = Field(default=0.04, gt=0.0, lt=10.0)
    robust_z: float = Field(default=4.0, gt=0.0, le=100.0)
    confirm_windows: int = Field(default=2, ge=1, le=1000)
    history_windows: int = Field(default=20, ge=2, le=100_000)
    job_slowdown: float = Field(default=0.08, gt=0.0, lt=10.0)
    confidence_floor: float = Field(default=0.5, ge=0.0, le=1.0)
    recover_windows: int = Field(default=3, ge=1, le=1000)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    analysis: AnalysisSettings = AnalysisSettings()
    # Where each setting came from, for errors raised after parsing.
    sources: dict[str, Setting] = Field(default_factory=dict, exclude=True)


@dataclass(frozen=True)
class KeySpec:
    section: str
    field: str
    doc: str


# Key (as written in artemis.conf, CamelCase) -> where it goes.
KEYS: dict[str, KeySpec] = {
    "WindowSteps": KeySpec("analysis", "window_steps", "steps per window the probe aggregates"),
    "MinSlowdown": KeySpec("analysis", "min_slowdown", "relative busy excess over island median to flag"),
    "RobustZ": KeySpec("analysis", "robust_z", "robust z-score (MAD units) needed to flag"),
    "ConfirmWindows": KeySpec("analysis", "confirm_windows", "consecutive flagged windows to confirm"),
    "HistoryWindows": KeySpec("analysis", "history_windows", "healthy windows kept per baseline"),
    "JobSlowdown": KeySpec("analysis", "job_slowdown", "job-wide step-time rise vs baseline to flag"),
    "ConfidenceFloor": KeySpec("analysis", "confidence_floor", "below this confidence a cause is 'unknown'"),
    "RecoverWindows": KeySpec("analysis", "recover_windows", "healthy windows that end an incident"),
}
_KEY_BY_LOWER = {k.lower(): k for k in KEYS}

SECTIONS: dict[str, type[_Section]] = {"analysis": AnalysisSettings}


def _section_values(lines: list[ConfLine]) -> tuple[dict[str, dict[str, Any]], dict[str, Setting]]:
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    sources: dict[str, Setting] = {}
    for line in lines:
        for setting in line.settings:
            canonical = _KEY_BY_LOWER.get(setting.key.lower())
            if canonical is None:
                raise ConfigError(setting.file, setting.line, setting.key, "unknown key")
            spec = KEYS[canonical]
            values[spec.section][spec.field] = setting.value
            sources[f"{spec.section}.{spec.field}"] = setting
    return values, sources


def build_config(lines: list[ConfLine], origin: str = "<defaults>") -> Config:
    values, sources = _section_values(lines)
    sections: dict[str, _Section] = {}
    for name, model in SECTIONS.items():
        try:
            sections[name] = model(**values[name])
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            field_name = str(first["loc"][0]) if first["loc"] else ""
            src = sources.get(f"{name}.{field_name}")
            key = src.key if src else field_name
            raise ConfigError(src.file if src else origin, src.line if src else None, key,
                              f"bad value {src.value if src else ''!r}: {first['msg']}") from None
    return Config(**sections, sources=sources)


def load_config(path: str | Path | None) -> Config:
    """Read artemis.conf; ``None`` gives the embedded defaults."""
    if path is None:
        return Config()
    return build_config(read_lines(path), str(path))


def parse_config_text(text: str, name: str = "<text>") -> Config:
    """Parse config text (tests, embedded examples) exactly as a file."""
    lines = [ConfLine(_split_pairs(raw.strip(), name, n))
             for n, raw in enumerate(text.splitlines(), start=1)
             if raw.strip() and not raw.strip().startswith("#")]
    return build_config(lines, name)

