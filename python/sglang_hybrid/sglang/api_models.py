"""Request models of the plugin's routes (issue #38): what each accepts, checked before anything
reaches a scheduler.

Pydantic models, as FastAPI and SGLang validate their own requests, in strict mode: an unknown
field is refused (a typo such as ``"cutt"`` must not silently drop the cut), ``true`` is not an
integer nor ``1`` a boolean, numbers are bounded (a TTL of 1e308 seconds is a mistake, not a
pin). Each refusal is a 400 in OpenAI's shape naming the field (``api_errors.py``). What needs
the served model is checked once the prompt is known (:func:`check_prompt`): every token id
inside the vocabulary and the prompt shorter than the context, the checks ``/generate`` makes,
so a prompt these routes accept is one ``/generate`` would accept.

The body is read here too (:func:`read_json`): not UTF-8, not JSON, JSON's non-standard
``NaN`` / ``Infinity``, or not an object each get their own message.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .api_errors import ApiError, bad_request, from_validation

MAX_POSITION = (1 << 31) - 1  # token positions and counts (SGLang's ids are int32)
MAX_TTL_S = 30 * 24 * 3600.0  # a durable pin's TTL: 30 days at most (a longer one: no TTL)
PROMPT_FIELDS = ("input_ids", "text", "messages")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PromptRequest(_Strict):
    """A prompt, as exactly one of ``input_ids``, ``text`` (tokenized as ``/generate`` does) or
    chat ``messages`` (rendered with the served template, as ``/v1/chat/completions`` does;
    ``tools``, ``chat_template_kwargs`` and ``add_generation_prompt`` go with them); and the
    cache namespace ``/generate`` takes (``extra_key``, ``cache_salt``)."""

    input_ids: list[int] | None = Field(None, min_length=1)
    text: str | None = Field(None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    extra_key: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptRequest:
        given = [k for k in PROMPT_FIELDS if getattr(self, k) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(
                f"give the prompt as exactly one of input_ids, text or messages (got {got})"
            )
        return self

    @field_validator("tools", "chat_template_kwargs", "add_generation_prompt")
    @classmethod
    def _with_messages(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("messages") is None:
            raise ValueError("goes with messages (a chat prompt) only")
        return v

    @property
    def prompt_field(self) -> str:
        return next(k for k in PROMPT_FIELDS if getattr(self, k) is not None)

    def namespace(self) -> dict[str, str]:
        return {
            k: v for k, v in (("extra_key", self.extra_key), ("cache_salt", self.cache_salt)) if v
        }


class BoundariesRequest(PromptRequest):
    """``POST /hybrid/boundaries``: ``cut`` (a token position, at most the prompt's length, which
    :func:`check_prompt`'s caller checks once the prompt is tokenized) and ``snap_tolerance``."""

    cut: int | None = Field(None, ge=0, le=MAX_POSITION)
    snap_tolerance: int = Field(512, ge=0, le=MAX_POSITION)


class CheckpointRequest(PromptRequest):
    """``POST /hybrid/checkpoint``: ``durable`` (pin in the host tier), ``ttl_s`` (release the pin
    after this many seconds; only with ``durable``; at most 30 days)."""

    durable: bool = False
    ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S, allow_inf_nan=False)

    @field_validator("ttl_s")
    @classmethod
    def _ttl_needs_durable(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and info.data.get("durable") is not True:
            raise ValueError('releases a durable pin: add "durable": true, or drop ttl_s')
        return v


class ReleaseRequest(PromptRequest):
    """``DELETE /hybrid/checkpoint``: the prompt whose durable checkpoint goes back to normal."""


class SlotsQuery(BaseModel):
    """``GET /slots`` query: ``id_slot`` (a recency rank, 0 = newest) or ``rid`` (a request id)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id_slot: str | None = None
    rid: str | None = Field(None, min_length=1, max_length=512)

    @field_validator("id_slot")
    @classmethod
    def _slot_number(cls, v: str | None) -> str | None:
        if v is not None and not (v.isascii() and v.isdigit() and len(v) <= 9):
            raise ValueError("a slot number is a non-negative integer (0 is the newest)")
        return v

    @model_validator(mode="after")
    def _one_selector(self) -> SlotsQuery:
        if self.id_slot is not None and self.rid is not None:
            raise ValueError("give id_slot or rid, not both")
        return self


class EmptyQuery(BaseModel):
    """Routes that take no query parameters (``GET /props``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def parse(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e.errors(include_url=False)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise bad_request("the body is empty: send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"the body is not UTF-8 (byte {e.start}): send a JSON object", code="invalid_json"
        ) from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of over 4300 digits
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    return body


def check_prompt(ids: list[int], field: str, *, vocab_size: int, context_len: int) -> None:
    """The checks ``/generate`` makes on a prompt: ids in the vocabulary, shorter than the context.

    ``min``/``max`` run in C; the offending position is looked for only once one is known."""
    if not ids:
        raise bad_request(f"{field}: the prompt has no tokens", code="empty_prompt", param=field)
    if vocab_size > 0:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
            where = f"input_ids[{i}]" if field == "input_ids" else field
            raise bad_request(
                f"{where} is {ids[i]}, outside the model's vocabulary [0, {vocab_size})",
                code="out_of_vocabulary",
                param=where,
            )
    if context_len > 0 and len(ids) >= context_len:
        raise bad_request(
            f"the prompt ({len(ids)} tokens) is longer than the model's context length "
            f"({context_len} tokens)",
            code="context_length_exceeded",
            param=field,
        )


def check_cut(req: BoundariesRequest, n: int) -> None:
    if req.cut is not None and req.cut > n:
        raise bad_request(
            f"cut: {req.cut} is past the prompt's end; a cut is a token position in [0, {n}]",
            code="out_of_range",
            param="cut",
        )


__all__ = [
    "ApiError",
    "BoundariesRequest",
    "CheckpointRequest",
    "EmptyQuery",
    "PromptRequest",
    "ReleaseRequest",
    "SlotsQuery",
    "check_cut",
    "check_prompt",
    "parse",
    "read_json",
]
