"""The opt-in trace: every spec move, every compiled operation segment and
effect, every join wait and every facade call, recorded into a bounded
in-memory ring and written as JSON lines by a background writer
(docs/trace.md describes the format; ``omni-prefix-cache validate`` replays
it against the specs).

Recording sites call ``Trace`` only where they already check a telemetry
attribute: each compiled machine's ``recorder`` (a ``TraceRecorder`` while a
trace is open), the operations the controller compiled while one was open,
and the facade methods of a manager built with one. With no trace open none
of those exist, so the off path pays the None check it already paid.

The hot path builds one tuple and appends it to a deque (atomic in CPython);
the writer turns tuples into JSON on its own thread, every ``interval_s`` or
at close, and flushes per batch: a killed process's file is readable up to
the last line it flushed (a torn last line is reported and skipped). A full
ring drops records and says so in a ``lost`` record (the validator stops
there). One trace is open per process at a time.
"""

from __future__ import annotations

import atexit
import itertools
import json
import operator
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO, Any

from omni_prefix_cache.telemetry.moves import MoveRecorder

TRACE_ENV = "OMNI_PREFIX_CACHE_TRACE"
FORMAT_VERSION = 1
DEFAULT_CAPACITY = 1 << 18  # records held in memory before new ones are lost
DEFAULT_INTERVAL_S = 0.05

_now = time.monotonic_ns
_dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode
_ident = threading.get_ident


class _Context(threading.local):
    """What the calling thread is doing: its facade call, and the innermost
    compiled segment it runs (op name, segment-execution id, spec index)."""

    call = 0
    op = ""
    run = 0
    seg = -1
    step = -1


# ------------------------------------------------------------ instance ids


def _by_identity() -> Callable[[Any], Any]:
    """Ids for objects that carry none: a counter per live object (weakly
    held), so an id is never reused within one trace."""
    names: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    counter = itertools.count(1)

    def name(obj: Any) -> Any:
        try:
            n = names.get(obj)
            if n is None:
                n = names[obj] = next(counter)
            return n
        except TypeError:  # neither hashable nor weakly referable
            return id(obj)

    return name


def _id_getter(kind: type) -> Callable[[Any], Any]:
    """How instances of ``kind`` are named in a trace: ints and strings as
    they are, tuples as lists of names, an object by its ``trace_id``,
    ``tid`` or ``step_id`` attribute, anything else by identity."""
    if kind is int or kind is str:
        return lambda key: key
    if issubclass(kind, tuple):
        return lambda key: [trace_id(part) for part in key]
    for attr in ("trace_id", "tid", "step_id"):
        if hasattr(kind, attr) or attr in getattr(kind, "__dataclass_fields__", {}):
            return operator.attrgetter(attr)
    return _by_identity()


_GETTERS: dict[type, Callable[[Any], Any]] = {}


def trace_id(key: Any) -> Any:
    """The JSON name of a machine instance (``key`` as a recorder gets it)."""
    getter = _GETTERS.get(type(key))
    if getter is None:
        getter = _GETTERS[type(key)] = _id_getter(type(key))
    return getter(key)


def shape_of(value: Any, depth: int = 0) -> Any:
    """A facade argument's shape, never its data: a tensor's shape and
    dtype, a sequence's length (a short one item by item), a scalar as is."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return {"shape": list(shape), "dtype": str(value.dtype).replace("torch.", "")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): shape_of(v, depth + 1) for k, v in list(value.items())[:16]} if depth < 2 else len(value)
    if isinstance(value, (list, tuple)):
        return [shape_of(v, depth + 1) for v in value] if depth < 1 and len(value) <= 16 else {"len": len(value)}
    attrs = getattr(value, "__dict__", None)
    if depth == 0 and isinstance(attrs, dict):  # a scheduler output: its public fields' shapes
        return {"type": type(value).__name__, **{k: shape_of(v, 1) for k, v in attrs.items() if not k.startswith("_")}}
    return type(value).__name__


# ------------------------------------------------------------ the trace


class Trace:
    """One open trace file. The recording methods may be called from any
    thread and never block; ``close`` from one thread (the manager's
    shutdown, process exit)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int = DEFAULT_CAPACITY,
        interval_s: float = DEFAULT_INTERVAL_S,
        header: dict[str, Any] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.ctx = _Context()
        self._q: deque[tuple[Any, ...]] = deque()
        self._capacity = capacity
        self._lost = 0
        self._interval = interval_s
        self._labels: dict[str, Sequence[tuple[str, str, str]]] = {}
        self._calls = itertools.count(1)
        self._runs = itertools.count(1)
        self._threads: dict[int, str] = {}
        self._quotes: dict[str, str] = {}  # a name -> its JSON string
        self._moves: dict[tuple[str, int], str] = {}  # (machine, move index) -> its JSON fields
        self._seq = 0
        self._file: IO[str] = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()  # one drainer at a time: lines stay in record order
        self.closed = False
        head = {"k": "trace", "v": FORMAT_VERSION, "pid": os.getpid(), "t": _now(), **(header or {})}
        self._file.write(_dumps(head) + "\n")
        self._file.flush()
        self._writer = threading.Thread(target=self._loop, name="omni-prefix-cache-trace", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # -------------------------------------------------------- hot path

    def _emit(self, rec: tuple[Any, ...]) -> None:
        if len(self._q) < self._capacity:
            self._q.append(rec)
        else:
            self._lost += 1

    def labels(self, machine: str, labels: Sequence[tuple[str, str, str]]) -> None:
        """(trigger, source, dest) per move index of ``machine`` (the writer
        spells moves out by them)."""
        self._labels[machine] = labels

    def moved(self, machine: str, index: int, key: Any, detail: Any = None) -> None:
        """Move ``index`` of ``machine`` applied to the instance ``key``
        (``_emit`` inlined: the most frequent record)."""
        c, q = self.ctx, self._q
        if len(q) < self._capacity:
            q.append(("mv", _now(), _ident(), c.call, c.op, c.run, c.seg, c.step, machine, index, key, detail))
        else:
            self._lost += 1

    def rows(self, machine: str, index: int, n: int, group: Any) -> None:
        """Move ``index`` applied to ``n`` rows at once (``group``: a key and
        its slot array, copied: the caller may reuse the array)."""
        c = self.ctx
        slots = getattr(group, "slots", None)
        key = getattr(group, "key", None)
        slots = slots.copy() if slots is not None else None
        self._emit(("rows", _now(), _ident(), c.call, c.op, c.run, c.seg, c.step, machine, index, key, n, slots))

    def segment(self, op: str, index: int, lock: str, run: Callable[[Any], Any], ids: Callable[[Any], Any]) -> Any:
        """``run`` (a compiled segment) recording its begin and end, under
        whatever lock its caller took (``ids(ctx)``: the instances it moves,
        one object or a list, named by the writer: ``trace_id`` runs on the
        writer thread only, so an id is given once)."""
        runs, ctx_of = self._runs, self.ctx

        def traced(ctx: Any) -> Any:
            c = ctx_of
            prev = (c.op, c.run, c.seg)
            c.op, c.run, c.seg = op, next(runs), index
            self._emit(("seg", _now(), _ident(), c.call, op, c.run, index, c.step, lock, ids(ctx)))
            try:
                return run(ctx)
            finally:
                self._emit(("end", _now(), _ident(), c.call, op, c.run, index, c.step, ids(ctx)))
                c.op, c.run, c.seg = prev

        return traced

    def effect(self, name: str, run: Callable[[Any], Any], ids: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``run`` (an effect handler) recorded before it runs."""
        ctx_of = self.ctx

        def traced(ctx: Any) -> Any:
            c = ctx_of
            self._emit(("fx", _now(), _ident(), c.call, c.op, c.run, c.seg, c.step, name, ids(ctx)))
            return run(ctx)

        return traced

    def waited(self, event: str, tids: Sequence[Any]) -> None:
        """A join saw ``event`` set on every task of ``tids``."""
        c = self.ctx
        self._emit(("wait", _now(), _ident(), c.call, c.op, c.run, c.seg, c.step, event, list(tids)))

    def call(self, facade: str, op: str, args: dict[str, Any], step: int) -> tuple[int, str, int, int, int]:
        """A facade call starts on this thread: it becomes the context of
        what the thread records. Returns what ``returned`` restores."""
        c = self.ctx
        prev = (c.call, c.op, c.run, c.seg, c.step)
        c.call, c.op, c.run, c.seg, c.step = next(self._calls), op, 0, -1, step
        self._emit(("call", _now(), _ident(), c.call, op, 0, -1, step, facade, args))
        return prev

    def returned(
        self, facade: str, prev: tuple[int, str, int, int, int], error: BaseException | None, result: Any
    ) -> None:
        c = self.ctx
        err = None if error is None else [type(error).__name__, str(error)[:300]]
        self._emit(("ret", _now(), _ident(), c.call, c.op, 0, -1, c.step, facade, err, result))
        c.call, c.op, c.run, c.seg, c.step = prev

    def set_step(self, step: int) -> None:
        self.ctx.step = step

    # -------------------------------------------------------- writer

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._flush_lock:
                self._drain()

    def _drain(self) -> None:
        q, lines = self._q, []
        pop = q.popleft
        while q:
            lines.append(self._line(pop()))
        lost, self._lost = self._lost, 0
        if lost:
            lines.append(_dumps({"k": "lost", "i": self._next(), "n": lost}))
        if lines and not self._file.closed:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _thread(self, ident: int) -> str:
        name = self._threads.get(ident)
        if name is None:
            found = [t.name for t in threading.enumerate() if t.ident == ident]
            name = self._threads[ident] = f"{found[0] if found else 'thread'}#{len(self._threads)}"
        return name

    def _head(self, kind: str, t: int, ident: int, call: int, op: str, run: int, seg: int, step: int) -> str:
        """The fields every record starts with, as JSON text (no braces)."""
        head = f'"k":"{kind}","i":{self._next()},"t":{t},"th":{self._quoted(self._thread(ident))}'
        if call:
            head += f',"call":{call}'
        if op:
            head += f',"op":{self._quoted(op)}'
        if run:
            head += f',"run":{run},"seg":{seg}'
        if step >= 0:
            head += f',"step":{step}'
        return head

    def _quoted(self, text: str) -> str:
        quoted = self._quotes.get(text)
        if quoted is None:
            quoted = self._quotes[text] = _dumps(text)
        return quoted

    def _line(self, rec: tuple[Any, ...]) -> str:
        """One record as a JSON line. The kinds a step writes most (moves,
        segments, effects) are spelled out directly; the rest through a dict."""
        kind = rec[0]
        if kind == "mv":
            machine, index, key, detail = rec[8:]
            move = self._moves.get((machine, index))
            if move is None:
                trigger, source, dest = self._labels[machine][index]
                move = self._moves[(machine, index)] = (
                    f'"m":{_dumps(machine)},"tr":{_dumps(trigger)},"s":{_dumps(source)},"d":{_dumps(dest)}'
                )
            iid = trace_id(key)
            extra = "" if detail is None else f',"x":{_dumps(detail)}'
            ids = str(iid) if type(iid) is int else _dumps(iid)
            return f'{{{self._head(*rec[:8])},"id":{ids},{move}{extra}}}'
        if kind == "seg":
            return f'{{{self._head(*rec[:8])},"lock":{self._quoted(rec[8])},"ids":{_dumps(_names(rec[9]))}}}'
        if kind == "end":
            return f'{{{self._head(*rec[:8])},"ids":{_dumps(_names(rec[8]))}}}'
        if kind == "fx":
            return f'{{{self._head(*rec[:8])},"name":{self._quoted(rec[8])},"ids":{_dumps(_names(rec[9]))}}}'
        return self._line_dict(rec)

    def _line_dict(self, rec: tuple[Any, ...]) -> str:
        kind, t, ident, call, op, run, seg, step = rec[:8]
        out: dict[str, Any] = {"k": kind, "i": self._next(), "t": t, "th": self._thread(ident)}
        if call:
            out["call"] = call
        if op:
            out["op"] = op
        if run:
            out["run"], out["seg"] = run, seg
        if step >= 0:
            out["step"] = step
        rest = rec[8:]
        if kind == "mv":
            machine, index, key, detail = rest
            out["m"], out["id"] = machine, trace_id(key)
            out["tr"], out["s"], out["d"] = self._labels[machine][index]
            if detail is not None:
                out["x"] = detail
        elif kind == "rows":
            machine, index, key, n, slots = rest
            out["m"], out["key"], out["n"] = machine, key, n
            out["tr"], out["s"], out["d"] = self._labels[machine][index]
            if slots is not None:
                out["slots"] = _ranges(slots)
        elif kind == "seg":
            out["lock"], out["ids"] = rest[0], _names(rest[1])
        elif kind == "end":
            out["ids"] = _names(rest[0])
        elif kind in ("fx", "wait"):
            out["name"], out["ids"] = rest[0], _names(rest[1])
        elif kind == "call":
            out["f"], out["args"] = rest
        elif kind == "ret":
            out["f"], err, result = rest
            if err is not None:
                out["err"] = err
            if result is not None:
                out["res"] = result
        return _dumps(out)

    def flush(self) -> None:
        """Write what the ring holds now (any thread; the writer does this
        every ``interval_s`` anyway)."""
        with self._flush_lock:
            self._drain()

    def close(self) -> None:
        """Write what is left, a ``close`` record, and close the file."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._writer is not threading.current_thread():
            self._writer.join(timeout=5.0)
        with self._flush_lock:
            self._drain()
        if not self._file.closed:
            self._file.write(_dumps({"k": "close", "i": self._next(), "t": _now()}) + "\n")
            self._file.close()
        atexit.unregister(self.close)


def _names(instances: Any) -> Any:
    """A segment's or effect's instances by their trace names (one, or a list)."""
    if instances is None:
        return None
    if isinstance(instances, list):
        return [trace_id(x) for x in instances]
    return trace_id(instances)


def _ranges(slots: Any) -> list[list[int]]:
    """Slot ids as ``[start, count]`` runs of consecutive ids (a step's
    slots are whole blocks: a few runs per request)."""
    values = [int(v) for v in slots.tolist()]
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


class TraceRecorder:
    """A compiled machine's recorder while a trace is open: each move goes
    to the trace and, when metrics are on, to ``metrics`` as well."""

    # The trace replays each instance's moves (tools.trace_check).
    per_instance = True

    def __init__(
        self, machine: str, labels: Sequence[tuple[str, str, str]], trace: Trace, metrics: MoveRecorder | None
    ):
        self.machine = machine
        self.trace = trace
        self.metrics = metrics
        trace.labels(machine, labels)

    def moved(self, move: Any, key: object, detail: Any = None) -> None:
        if self.metrics is not None:
            self.metrics.moved(move, key)
        self.trace.moved(self.machine, move.index, key, detail)

    def moved_batch(self, keys: Sequence[object], moves: Sequence[Any]) -> None:
        if self.metrics is not None:
            self.metrics.moved_batch(keys, moves)
        for key, move in zip(keys, moves):
            if move is not None:
                self.trace.moved(self.machine, move.index, key)

    def counted(self, move: Any, n: int, group: Any = None) -> None:
        if self.metrics is not None:
            self.metrics.counted(move, n)
        self.trace.rows(self.machine, move.index, n, group)

    def forget(self, key: object) -> None:
        if self.metrics is not None:
            self.metrics.forget(key)
