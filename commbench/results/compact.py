"""Rows held for analysis in a fraction of a Measurement's memory (issue 31: a 200 MB
measurements.jsonl is 2.7 x 10^5 rows; as Measurements they took 0.4 GB).

A row is split in two:
- its *profile*: every field but the numbers that change from row to row (backend, status,
  settings, reason, extra...), shared by every row with the same one: a sweep's rows have a few
  hundred profiles, not one a row;
- its numbers (size, count, latencies, jitter percentiles, bandwidths, timestamp), packed into
  one bytes object (8 bytes each, NaN standing for None: a row's floats are finite, validate.py).
A row with a number that would not come back the same from a double (an int latency) is kept
as it is. Iterating the rows gives each as a Measurement again, made on the spot and equal to the
one read; nothing is held per row but the profile's reference and the packed numbers.

Where rows share no profile (each imported nccl-tests row names its source line in `extra`),
each keeps its own: once more than half the rows past the first thousand had a new profile,
or MAX_PROFILES are held, no new one is remembered (nor its key made: a JSON text of its dicts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import struct
from typing import Any, Iterator, Sequence, overload

from commbench.results.schema import Measurement

_FIELDS = tuple(f.name for f in dataclasses.fields(Measurement))
_INTS = ("message_bytes", "count")
_FLOATS = ("latency_us", "latency_rank_mean_us", "jitter_p10_us", "jitter_p50_us", "jitter_p90_us", "jitter_p99_us",
           "jitter_min_us", "jitter_max_us", "algbw_gbps", "busbw_gbps", "timestamp")
_PACKED = _INTS + _FLOATS
_PROFILE = tuple(name for name in _FIELDS if name not in _PACKED)
_DICTS = tuple(i for i, name in enumerate(_PROFILE) if name in ("emulation", "requested", "observed", "env_setting",
                                                                 "extra"))
_FORMAT = struct.Struct(f"<{len(_INTS)}q{len(_FLOATS)}d")
_ALL = operator.attrgetter(*_FIELDS)
_SPLIT_PROFILE = operator.itemgetter(*(_FIELDS.index(name) for name in _PROFILE))
_SPLIT_PACKED = operator.itemgetter(*(_FIELDS.index(name) for name in _PACKED))
# Measurement's fields in order, from the profile followed by the unpacked numbers.
_JOIN = operator.itemgetter(*((_PROFILE + _PACKED).index(name) for name in _FIELDS))
_INT_LIMIT = 1 << 62
_FLOAT_KINDS = frozenset((float, type(None)))
_NAN = math.nan
MAX_PROFILES = 1 << 16


def _profile_key(profile: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The profile as a hashable key (its dicts as sorted JSON); None when it has no such form."""
    key = list(profile)
    for index in _DICTS:
        value = key[index]
        if value:
            try:
                key[index] = json.dumps(value, sort_keys=True)
            except (TypeError, ValueError):
                return None
        elif value is not None:
            key[index] = ()
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


class CompactRows(Sequence[Measurement]):
    """Rows, in the order added, held compactly; add() returns a position drop() takes."""

    def __init__(self) -> None:
        self._profiles: list[tuple[Any, ...] | None] = []
        self._packed: list[bytes | Measurement | None] = []   # a Measurement where its profile is None
        self._shared: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._sharing = True
        self._count = 0

    def add(self, row: Measurement) -> int:
        values = _ALL(row)
        numbers = _SPLIT_PACKED(values)
        packed = self._pack(numbers)
        profile = _SPLIT_PROFILE(values) if packed is not None else None
        if profile is not None and self._sharing:
            key = _profile_key(profile)
            shared = self._shared.get(key) if key is not None else None
            if shared is not None:
                profile = shared
            elif key is not None:
                self._shared[key] = profile
                held = len(self._shared)
                self._sharing = held < MAX_PROFILES and (held < 1024 or 2 * held < self._count)
        self._profiles.append(profile)
        self._packed.append(packed if profile is not None else row)
        self._count += 1
        return len(self._packed) - 1

    @staticmethod
    def _pack(numbers: tuple[Any, ...]) -> bytes | None:
        """The numbers packed; None when one would not come back as it is."""
        size, count = numbers[:len(_INTS)]
        floats = numbers[len(_INTS):]
        if (size.__class__ is not int or count.__class__ is not int or not -_INT_LIMIT <= size <= _INT_LIMIT
                or not -_INT_LIMIT <= count <= _INT_LIMIT or not _FLOAT_KINDS.issuperset(map(type, floats))):
            return None
        return _FORMAT.pack(size, count, *[_NAN if v is None else v for v in floats])

    def drop(self, position: int) -> None:
        """Forget the row added at `position` (a later row of the same key replaces it)."""
        if self._packed[position] is not None:
            self._profiles[position] = self._packed[position] = None
            self._count -= 1

    def finish(self) -> "CompactRows":
        """Done adding: dropped rows leave no gaps, so that rows[i] is the i-th row kept."""
        kept = [i for i, packed in enumerate(self._packed) if packed is not None]
        if len(kept) != len(self._packed):
            self._profiles = [self._profiles[i] for i in kept]
            self._packed = [self._packed[i] for i in kept]
        self._shared = {}
        return self

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Measurement]:
        for profile, packed in zip(self._profiles, self._packed):
            if packed is not None:
                yield _row(profile, packed)

    @overload
    def __getitem__(self, index: int) -> Measurement: ...
    @overload
    def __getitem__(self, index: slice) -> list[Measurement]: ...

    def __getitem__(self, index: int | slice) -> Measurement | list[Measurement]:
        if isinstance(index, slice):
            return list(self)[index]
        if len(self._packed) != self._count:
            return list(self)[index]   # before finish(): a checking aid, not a path analysis takes
        packed = self._packed[index]
        assert packed is not None
        return _row(self._profiles[index], packed)


def _row(profile: tuple[Any, ...] | None, packed: bytes | Measurement) -> Measurement:
    if profile is None:
        return packed   # type: ignore[return-value]   # kept as it was read
    numbers = _FORMAT.unpack(packed)   # type: ignore[arg-type]
    values = _JOIN(profile + numbers[:len(_INTS)] + tuple([None if v != v else v for v in numbers[len(_INTS):]]))
    row = Measurement(*values)
    for index in _DICTS:   # a profile's dicts are shared: each row gets copies it may change
        value = profile[index]
        if value is not None:
            setattr(row, _PROFILE[index], dict(value))
    return row
