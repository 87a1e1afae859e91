"""A request's headers, read once.

The request path looks headers up about twenty times (the key, the session and agent
headers, the reuse header, the trace context, the headers forwarded upstream). A
Starlette `Headers` scans its list for each lookup and raises KeyError inside `get` for
every header the client did not send; this reads the list once into a dict. Names are
case-insensitive, and of a repeated header the first counts, as Starlette's `get` has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar, overload

_T = TypeVar("_T")


class RequestHeaders(Mapping[str, str]):
    __slots__ = ("_values",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        values: dict[str, str] = {}
        for key, value in raw:
            values.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        self._values = values

    def __getitem__(self, key: str) -> str:
        return self._values[key.lower()]

    @overload
    def get(self, key: str, /) -> str | None: ...

    @overload
    def get(self, key: str, /, default: str | _T) -> str | _T: ...

    def get(self, key: str, /, default: str | _T | None = None) -> str | _T | None:
        return self._values.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)
