"""The ingest edge: request bodies to validated records, and whether their sender may send them.

Everything here is about one request and what Slurm says of its jobs; none of
it decides anything.  ``fast_records`` takes the common body (a clean JSON
array of window reports) in one msgspec pass; every other body goes the
careful way: ``decode_body`` reads a JSON array or JSON Lines item by
item (a bad item is an error of its own, the others are kept); ``validate``
turns items into wire records under today's bounds, naming the field of every
bad one; ``ownership_problem`` and ``claim_problem`` say why a user's record
does not fit its job in Slurm (owner, allocation, size).  The daemon stores and
analyses what passes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta
from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from artemisd.auth import Principal
from artemisd.slurm.api import JobInfo, SlurmError
from artemisd.slurm.cli import collect_hostlist
from artemisd.wire import (
    _BUSY_SLACK_MS,
    _BUSY_SLACK_REL,
    DEFAULT_MAX_WORLD,
    INT64_MAX,
    MAX_ID,
    MAX_ITEMS,
    MAX_STEPS,
    MAX_TEXT,
    THROTTLE_REASONS,
    NodeEvent,
    Record,
    ReportError,
    ThrottleReason,
    WindowReport,
    parse_record,
)

MAX_ITEMS_PER_REQUEST = 100_000
MAX_DEPTH = 200  # pydantic-core's fixed nesting limit; a wire record needs 4
_TOO_DEEP = "recursion limit exceeded"  # how pydantic-core says it
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_BATCH = TypeAdapter(list[Record])


class IngestError(ValueError):
    """The request body as a whole is unreadable (HTTP 400)."""


@dataclass
class IngestResult:
    accepted: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)
    directives: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": self.rejected, "directives": self.directives}


@dataclass
class Submission:
    """One request's validated records on their way to the store (``Daemon.accept_many``).

    ``jobs``: what Slurm says of a user's jobs (``Daemon.check_jobs``);
    ``rejected``: the request's items already refused by validation;
    ``body``: the request body where ``fast_records`` took it whole;
    ``size``: the request body's bytes, what its rows will roughly take.
    """

    records: list[tuple[int, Any]]
    principal: Principal
    jobs: dict[str, JobInfo | None | SlurmError | LookupRefused] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    body: bytes | None = None
    size: int = 0


def decode_body(body: bytes) -> list[tuple[int, Any, str | None]]:
    """A JSON array or JSON Lines -> [(index, value or None, error)]; a bad item is an error of its own.

    pydantic-core's parser (``from_json``, twice as fast as ``json.loads``)
    decodes the common case.  It has a fixed nesting limit (``MAX_DEPTH``)
    instead of Python's stack, and refuses invalid UTF-8 and lone surrogate
    escapes; an item it refuses for those goes through ``json.loads`` (invalid
    bytes kept as lone surrogates), so the wire models can name the field that
    holds them, and only that item is refused.  A JSON array is one value: an
    element too deep to decode ends the reading there (the elements before it
    are kept); any other syntax error in a one-line array refuses the body.
    A body of several lines that starts with ``[`` and cannot be read to its end
    as one array is JSON Lines: its first line is one item, whatever it holds.
    """
    text = body.strip()
    if not text:
        return []
    if text.startswith(b"["):
        try:
            values = from_json(text)
        except ValueError:
            items = _split_array(text)
        else:
            if len(values) > MAX_ITEMS_PER_REQUEST:
                raise IngestError(f"more than {MAX_ITEMS_PER_REQUEST} items in one request")
            items = [(i, value, None) for i, value in enumerate(values)]
        if items is not None:
            return items
    out: list[tuple[int, Any, str | None]] = []
    for i, line in enumerate(text.split(b"\n")):
        if i >= MAX_ITEMS_PER_REQUEST:
            raise IngestError(f"more than {MAX_ITEMS_PER_REQUEST} items in one request")
        try:
            out.append((i, from_json(line), None))
        except ValueError as err:
            out.append(_careful_item(i, line, str(err)))
    return out


def _careful_item(index: int, raw: bytes, why: str) -> tuple[int, Any, str | None]:
    """An item pydantic-core refused: too deep stays refused; otherwise the standard library tries."""
    if _TOO_DEEP in why:
        return index, None, f"not JSON: nested deeper than {MAX_DEPTH} levels"
    try:
        return index, json.loads(raw.decode("utf-8", errors="surrogateescape")), None
    except json.JSONDecodeError as err:
        return index, None, f"not JSON: {err.msg} at column {err.colno}"
    except RecursionError:
        return index, None, f"not JSON: nested deeper than {MAX_DEPTH} levels"


def _split_array(body: bytes) -> list[tuple[int, Any, str | None]] | None:
    """Element by element through an array pydantic-core refused as a whole.

    None: not one JSON array (a syntax error): the caller reads JSON Lines when
    the body has several lines, or refuses the body.  Where the reading would end
    early (an element too deep, too many elements) in a body of several lines,
    the body must first prove to be one array (``_one_array``): JSON Lines whose
    first line is that deep or that long would lose every good line after it.
    """
    text = body.decode("utf-8", errors="surrogateescape")
    decoder = json.JSONDecoder()
    out: list[tuple[int, Any, str | None]] = []
    pos = _skip_ws(text, 1)
    if text.startswith("]", pos):
        return out if _skip_ws(text, pos + 1) == len(text) else _not_an_array(text, "trailing data")
    while True:
        index = len(out)
        if index >= MAX_ITEMS_PER_REQUEST:
            if _json_lines(body):
                return None
            raise IngestError(f"more than {MAX_ITEMS_PER_REQUEST} items in one request")
        try:
            value, end = decoder.raw_decode(text, pos)
        except RecursionError:
            if _json_lines(body):
                return None
            out.append((index, None, f"not JSON: nested deeper than {MAX_DEPTH} levels; "
                                     f"the rest of the array was not read"))
            return out
        except json.JSONDecodeError as err:
            return _not_an_array(text, f"{err.msg} at column {err.colno}")
        segment = text[pos:end]
        # Only a segment with that many brackets can be too deep: parse it again to be sure.
        if segment.count("[") + segment.count("{") > MAX_DEPTH and _deeper_than_limit(segment):
            out.append((index, None, f"not JSON: nested deeper than {MAX_DEPTH} levels"))
        else:
            out.append((index, value, None))
        pos = _skip_ws(text, end)
        if text.startswith(",", pos):
            pos = _skip_ws(text, pos + 1)
        elif text.startswith("]", pos):
            return out if _skip_ws(text, pos + 1) == len(text) else _not_an_array(text, "trailing data")
        else:
            return _not_an_array(text, f"expected ',' or ']' at column {pos + 1}")


_ESCAPE = re.compile(rb"\\.")  # \" and \\ inside a string: neither opens nor closes one
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_SCAN_CHUNK = 1 << 18  # small enough for the temporaries to come from the allocator's cache, not fresh pages


def _json_lines(body: bytes) -> bool:
    return b"\n" in body and not _one_array(body)


def _one_array(body: bytes) -> bool:
    """Whether the ``[`` that starts ``body`` closes at its very end and nowhere before.

    Brackets are counted outside strings, to any depth, in numpy (~3 ms a MB,
    paid only where ``_split_array`` would end early).  JSON Lines with one bad
    line never pass: the good lines after it are balanced, so the first ``[``
    closes on the first line or never, and a string left open runs into a
    newline.  A pretty-printed array passes, whatever its elements hold.
    Mismatched kinds (``[}``) pass here and fail in ``_split_array``, which
    then finds it is not an array.
    """
    if b"\\" in body:
        body = _ESCAPE.sub(b"", body)
    raw = np.frombuffer(body, dtype=np.uint8)
    quotes, depth = 0, 0
    for start in range(0, len(raw), _SCAN_CHUNK):
        chunk = raw[start:start + _SCAN_CHUNK]
        seen = np.cumsum(chunk == ord('"'), dtype=np.int32)
        seen += quotes
        in_string = (seen & 1).astype(bool)  # from an opening quote up to its closing one
        if (in_string & (chunk == ord("\n"))).any():
            return False  # a string cannot hold a raw newline: not JSON, so not one array
        quotes = int(seen[-1]) & 1
        steps = _BRACKET_STEP.take(chunk)
        steps[in_string] = 0
        running = np.cumsum(steps, dtype=np.int32)
        running += depth
        last = start + len(chunk) == len(raw)
        if (running[:-1] if last else running).min(initial=1) <= 0:
            return False
        depth = int(running[-1])
    return quotes == 0 and depth == 0


def _not_an_array(text: str, why: str) -> None:
    if "\n" not in text:
        raise IngestError(f"body is not a JSON array: {why}")
    return None  # JSON Lines whose first line happens to be an array (an item error)


def _skip_ws(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _deeper_than_limit(segment: str) -> bool:
    try:
        from_json(segment.encode("utf-8", errors="surrogateescape"))
    except ValueError as err:
        return _TOO_DEEP in str(err)
    return False


def claim_problem(rec: WindowReport | NodeEvent, info: JobInfo) -> str | None:
    """Why ``rec`` does not fit what Slurm says of its job ("field: reason"), or None.

    A report may only name a node of the job's allocation: otherwise a job's
    owner could pin a slowdown, and so a drain, on anyone's node.  ``world``
    may not exceed the ranks the job can run (``JobInfo.max_world``).
    """
    if rec.node not in info.nodes:
        if not info.nodes:
            return f"node: job {info.job_id} has no nodes allocated (state {info.state})"
        return f"node: {rec.node} is not in job {info.job_id}'s allocation {collect_hostlist(info.nodes)}"
    if rec.type == "window":
        limit = info.max_world
        if limit is not None and rec.world > limit:
            return (f"world: {rec.world} is more ranks than job {info.job_id} can run "
                    f"({info.tasks or '?'} tasks, {info.cpus or '?'} CPUs in Slurm)")
    return None


def validate(items: list[tuple[int, Any, str | None]], context: dict[str, Any],
             unforeseen: Callable[[BaseException], str]) -> tuple[list[tuple[int, WindowReport | NodeEvent]],
                                                                 list[dict[str, Any]]]:
    """Items -> ([(index, record)], [{"index", "error"}]).

    A clean batch is validated in one pydantic call (the common case, and
    2-3x cheaper than item by item); any error sends the batch through the
    per-item path, which names every bad item's field and reason.
    ``unforeseen`` turns a failure no bound foresaw into the item's reason
    (the daemon logs each kind once).
    """
    if all(error is None for _, _, error in items):
        try:
            records = _BATCH.validate_python([obj for _, obj, _ in items], context=context)
            return [(index, rec) for (index, _, _), rec in zip(items, records)], []
        except ValidationError:
            pass
        except Exception as err:  # noqa: BLE001 - the per-item path below names the item
            unforeseen(err)
    good: list[tuple[int, WindowReport | NodeEvent]] = []
    bad: list[dict[str, Any]] = []
    for index, obj, error in items:
        if error is not None:
            bad.append({"index": index, "error": error})
            continue
        try:
            good.append((index, parse_record(obj, context=context)))
        except ReportError as err:
            bad.append({"index": index, "error": "; ".join(f"{p or '<record>'}: {r}" for p, r in err.problems)})
        except Exception as err:  # noqa: BLE001 - one item's failure never drops the others
            bad.append({"index": index, "error": unforeseen(err)})
    return good, bad


@dataclass(frozen=True)
class LookupRefused:
    """A job artemisd did not ask Slurm about for this request (``jobs.JobLookups``), and why."""

    reason: str


def ownership_problem(rec: WindowReport | NodeEvent, principal: Principal,
                      jobs: dict[str, JobInfo | None | SlurmError | LookupRefused]) -> str | None:
    """Why a user's record may not be stored ("field: reason"), or None: Slurm (``jobs``) must say
    the sender owns its job, and the record must fit the job's allocation and size."""
    if rec.job is None:
        return "job: node events without a job need root or SlurmUser credentials"
    info = jobs.get(rec.job)
    if isinstance(info, LookupRefused):
        return f"job: {info.reason}"
    if isinstance(info, SlurmError):
        # Never trusted unchecked, never dropped silently: the sender is told to send it again.
        return f"job: Slurm could not be reached to check job {rec.job} ({info}); not stored, send it again"
    if info is None:
        return f"job: {rec.job} is not known to Slurm"
    if info.user_id != principal.uid:
        return f"job: {rec.job} is not owned by {principal.who}"
    return claim_problem(rec, info)


# --- the fast path: a clean array of window reports -------------------------
#
# Validating every report through the pydantic models cost ~50 us each, and
# building even unvalidated pydantic objects ~18 us (a report is up to eight
# models), so a 100k-rank window cost seconds of CPU before any analysis.
# msgspec decodes and checks the per-field bounds straight from the bytes into
# frozen Structs (C, no intermediate dicts); the cross-field rules are one
# Python loop; and the Structs themselves are the records the daemon keeps and
# analyses: they have the wire models' fields, names and values (the careful
# path's records and these are read the same way, by attribute; ``rec.type``
# tells a window report from a node event on both).  The fast path is a strict
# subset of the wire models: it accepts only window reports without unknown
# fields, with every value of the exact JSON type (a job id as a number, an
# integer written 3.0, an unknown field: all valid, all left to the careful
# path).  Anything it does not accept goes, as a whole body, through
# ``decode_body`` + ``validate``, which keep naming every bad item's field and
# reason as before.

_FLOAT_MAX = sys.float_info.max
# Finite: a value beyond float range or NaN never reaches a model (the parser
# refuses NaN/Infinity tokens and overflowing numbers; ``le`` keeps it so).
_Finite = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
_NonNegative = Annotated[float, Meta(ge=0, le=_FLOAT_MAX)]
_Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
_Text = Annotated[str, Meta(max_length=MAX_TEXT)]
_NonEmptyText = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]
_Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID)]
_Pct = Annotated[float, Meta(ge=0, le=100)]


class _Fast(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True, gc=False):
    # frozen: values, as the wire models are.  omit_defaults: encoded without
    # the fields left unmeasured (None), as ``dump_record`` writes a model.
    # gc=False: a record holds only scalars, strings and other records, never a
    # cycle, and a 100k-rank window is 500k objects the collector need not track.
    # kw_only below: fields in the wire models' order (a required one may follow a default)
    pass


class _Device(_Fast):
    vendor: _NonEmptyText
    model: _NonEmptyText
    index: _Count | None = None
    uuid: _Text | None = None


class _WindowSpan(_Fast):
    seq: _Count
    first_step: Annotated[int, Meta(ge=0, le=INT64_MAX - MAX_STEPS)]
    steps: Annotated[int, Meta(gt=0, le=MAX_STEPS)]
    t0: _Finite
    t1: _Finite


class _StepTimes(_Fast):
    step: _NonNegative
    busy: _NonNegative | None = None
    compute: _NonNegative | None = None
    data: _NonNegative | None = None
    comm_wait: _NonNegative | None = None


class _Collective(_Fast, kw_only=True):
    op: _NonEmptyText
    group: _Text = "world"
    calls: _Count
    bytes: _NonNegative | None = None
    ms: _NonNegative


class _Gpu(_Fast):
    sm_clock_mhz: _NonNegative | None = None
    max_sm_clock_mhz: _NonNegative | None = None
    power_w: _NonNegative | None = None
    power_limit_w: _NonNegative | None = None
    default_power_limit_w: _NonNegative | None = None
    temp_c: _Finite | None = None
    util_pct: _Pct | None = None
    throttle: Annotated[tuple[ThrottleReason, ...], Meta(max_length=len(THROTTLE_REASONS))] | None = None
    ecc_uncorrected: _Count | None = None
    pcie_replay: _Count | None = None


class _Host(_Fast):
    cpu_pct: _NonNegative | None = None
    steal_pct: _NonNegative | None = None
    iowait_pct: _NonNegative | None = None
    ctx_invol_per_s: _NonNegative | None = None
    net_retransmits_per_s: _NonNegative | None = None
    cpu_throttled_pct: _NonNegative | None = None
    run_wait_ms_per_s: _NonNegative | None = None


class _Env(_Fast):
    driver: _Text | None = None
    comm_lib: _Text | None = None
    torch: _Text | None = None
    config: _Text | None = None


class _P2P(_Fast):
    peer: _Count
    ms: _NonNegative
    node: Annotated[str, Meta(max_length=MAX_ID)] | None = None
    wait_ms: _NonNegative | None = None


class _Probe(_Fast):
    id: Annotated[str, Meta(max_length=MAX_ID)]
    gemm_ms: _NonNegative | None = None
    gemm_tflops: _NonNegative | None = None
    allreduce_ms: _NonNegative | None = None
    p2p: Annotated[tuple[_P2P, ...], Meta(max_length=MAX_ITEMS)] = ()
    served_wait_ms: _NonNegative | None = None
    cost_ms: _NonNegative | None = None


class FastReport(_Fast, kw_only=True):
    type: Literal["window"]
    v: Literal[1]
    job: _Id
    step: _Id = "0"
    rank: _Count
    world: Annotated[int, Meta(gt=0, le=INT64_MAX)]
    node: _Id
    device: _Device | None = None
    island: Annotated[str, Meta(max_length=MAX_ID)] | None = None
    window: _WindowSpan
    ms: _StepTimes
    ms_p50: Annotated[dict[Annotated[str, Meta(max_length=32)], _NonNegative], Meta(max_length=16)] | None = None
    samples: _NonNegative | None = None
    collectives: Annotated[tuple[_Collective, ...], Meta(max_length=MAX_ITEMS)] | None = None
    gpu: _Gpu | None = None
    host: _Host | None = None
    env: _Env | None = None
    probe: _Probe | None = None
    dropped_reports: _Count | None = None
    relay_dropped: _Count | None = None
    rebalance_opt_in: bool | None = None


_FAST_BATCH = msgspec.json.Decoder(Annotated[list[FastReport], Meta(max_length=MAX_ITEMS_PER_REQUEST)])


def _window_report(raw: FastReport, max_world: int) -> FastReport | None:
    """The report (``busy`` derived where it was left out), or None where a cross-field rule of the
    wire models refuses it (the careful path says why)."""
    ms = raw.ms
    busy = ms.busy
    if busy is None:
        if ms.comm_wait is None:
            return None
        busy = max(0.0, ms.step - ms.comm_wait)
    if busy > ms.step + _BUSY_SLACK_MS:
        return None
    if ms.comm_wait is not None and abs(ms.step - ms.comm_wait - busy) > max(_BUSY_SLACK_MS,
                                                                               _BUSY_SLACK_REL * ms.step):
        return None
    span = raw.window
    if span.t1 < span.t0 or raw.rank >= raw.world or raw.world > max_world:
        return None
    if ms.busy is None:
        # Derived once, on the way in, as StepTimes derives it: nobody else holds the record yet.
        msgspec.structs.force_setattr(ms, "busy", busy)
    return raw


def fast_records(body: bytes, max_world: int = DEFAULT_MAX_WORLD) -> list[tuple[int, FastReport]] | None:
    """A JSON array of valid window reports -> [(index, record)]: the records ``validate(decode_body(body))``
    gives, field for field, as ``FastReport`` Structs.

    None when the body is anything else (JSON Lines, a node event, an unknown
    field, an item that breaks a bound): the caller takes the careful path,
    which names each bad item's field and reason.

    The fast path takes no unknown field and checks every value, so each item
    of a body it took is the record and nothing else, and parses back to it
    (``parse_record``): the daemon stores the body as it came (``Daemon.accept``).
    """
    try:
        raws = _FAST_BATCH.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    out: list[tuple[int, FastReport]] = []
    for index, raw in enumerate(raws):
        rec = _window_report(raw, max_world)
        if rec is None:
            return None
        out.append((index, rec))
    return out
