"""One JSON Lines record decoded into a ``msgspec.Struct``, or a ``TraceFormatError`` saying why.

``decode_line(decoder, text, path, line)``: the loaders declare each line's fields, types and
single-field bounds as a Struct; msgspec checks them while decoding. A failure names the file,
the 1-based line, the field (``hash_ids[3]``), the value found there and what was expected:
``t.jsonl:7: hash_ids[3] = -4: Expected `int` >= 0``. Checks across fields or lines stay in the
loaders and raise ``TraceFormatError`` themselves.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ..errors import TraceFormatError

T = TypeVar("T")

_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<where>[^`]*)`$")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_SHOWN = 60  # characters of an offending value quoted in the message


def decode_line(decoder: msgspec.json.Decoder[T], text: str, path: Path, line: int) -> T:
    """``text`` decoded by ``decoder``; ``TraceFormatError`` for bad JSON or a bad field."""
    try:
        return decoder.decode(text)
    except msgspec.ValidationError as e:  # a DecodeError too: caught first
        raise TraceFormatError(path, line, _explain(str(e), text)) from None
    except msgspec.DecodeError as e:
        raise TraceFormatError(path, line, f"not JSON: {e}") from None


def _explain(message: str, text: str) -> str:
    """msgspec's "<what> - at `$.a[0]`" as "a[0] = <value>: <what>"."""
    m = _AT.match(message)
    if m is None:  # about the whole line: a missing or unknown field, not an object
        return message
    where = m["where"].removeprefix(".")
    try:
        value: Any = msgspec.json.decode(text)
        for name, index in _STEP.findall(m["where"]):
            value = value[name] if name else value[int(index)]
    except (msgspec.DecodeError, LookupError):  # a number out of range: no value to show
        return f"{where}: {m['what']}"
    shown = msgspec.json.encode(value).decode()
    if len(shown) > _SHOWN:
        shown = shown[: _SHOWN - 3] + "..."
    return f"{where} = {shown}: {m['what']}"
