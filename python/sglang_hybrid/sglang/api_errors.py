"""One error shape for every route the plugin adds (issue #38): OpenAI's.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "cut",
               "code": "out_of_range"}}

``message`` says what was wrong and how to fix it, ``type`` is OpenAI's class of error (from the
status), ``param`` names the request field at fault (``input_ids[3]``, ``cut``, ``id_slot``; null
when no single field is), ``code`` is a stable machine-readable string (the table in
``docs/compaction.md``, "Errors"). A client's mistake is a 4xx naming the field; a 5xx never
echoes the exception (the server log has it, as SGLang's own HTTP layer does for 5xx).

Responses are serialized with orjson (what SGLang's app uses) into a plain Starlette
``Response``: FastAPI deprecates its ``ORJSONResponse`` class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI's error classes by status (the rest of 4xx is invalid_request_error).
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
MAX_INPUT_ECHO = 60  # characters of an offending value quoted back in a message


class ApiError(Exception):
    """An answer other than 200 from one of our routes (raised anywhere below a route)."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, code: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def internal_error() -> ApiError:
    return ApiError(
        500,
        "internal server error: the server log has the details",
        code="internal_error",
    )


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    import orjson
    from starlette.responses import Response

    return Response(
        orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Any:
    return json_response(err.body(), err.status, headers)


def field_name(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the client wrote it: ``("input_ids", 3)`` -> ``input_ids[3]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def echo(value: Any) -> str:
    """A short rendering of an offending value (never the whole of a long one)."""
    text = "true" if value is True else "false" if value is False else repr(value)
    if value is None:
        text = "null"
    return text if len(text) <= MAX_INPUT_ECHO else text[: MAX_INPUT_ECHO - 1] + "…"


def from_validation(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Pydantic's errors as one 400: the first field at fault is ``param``; the message lists up
    to three (``field: what was wrong (got value)``)."""
    parts = []
    for e in errors[:3]:
        where = field_name(tuple(e.get("loc") or ()))
        what = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            what = "unknown field (this route takes no such field)"
        # Echo the offending value of a field (a model-level error's input is the whole body).
        echoed = where and "input" in e and e.get("type") != "missing"
        got = f" (got {echo(e['input'])})" if echoed else ""
        parts.append(f"{where}: {what}{got}" if where else f"{what}{got}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = errors[0] if errors else {}
    code = "unknown_field" if first.get("type") == "extra_forbidden" else "invalid_value"
    return bad_request(
        "; ".join(parts) + more,
        code=code,
        param=field_name(tuple(first.get("loc") or ())) or None,
    )
