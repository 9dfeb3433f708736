"""The ingest edge: request bodies to validated records, and whether their sender may send them.

Everything here is about one request and what Slurm says of its jobs; none of
it decides anything.  ``decode_body`` reads a JSON array or JSON Lines item by
item (a bad item is an error of its own, the others are kept); ``validate``
turns items into wire records under today's bounds, naming the field of every
bad one; ``ownership_problem`` and ``claim_problem`` say why a user's record
does not fit its job in Slurm (owner, allocation, size).  The daemon stores and
analyses what passes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from artemisd.auth import Principal
from artemisd.slurm.api import JobInfo, SlurmError
from artemisd.slurm.cli import collect_hostlist
from artemisd.wire import NodeEvent, Record, ReportError, WindowReport, parse_record

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
    the body has several lines, or refuses the body.
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
            raise IngestError(f"more than {MAX_ITEMS_PER_REQUEST} items in one request")
        try:
            value, end = decoder.raw_decode(text, pos)
        except RecursionError:
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
    if type(rec) is WindowReport:
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


def ownership_problem(rec: WindowReport | NodeEvent, principal: Principal,
                      jobs: dict[str, JobInfo | None | SlurmError]) -> str | None:
    """Why a user's record may not be stored ("field: reason"), or None: Slurm (``jobs``) must say
    the sender owns its job, and the record must fit the job's allocation and size."""
    if rec.job is None:
        return "job: node events without a job need root or SlurmUser credentials"
    info = jobs.get(rec.job)
    if isinstance(info, SlurmError):
        # Never trusted unchecked, never dropped silently: the sender is told to send it again.
        return f"job: Slurm could not be reached to check job {rec.job} ({info}); not stored, send it again"
    if info is None:
        return f"job: {rec.job} is not known to Slurm"
    if info.user_id != principal.uid:
        return f"job: {rec.job} is not owned by {principal.who}"
    return claim_problem(rec, info)
