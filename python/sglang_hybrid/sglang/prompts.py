"""Empty prompts refused before they reach the scheduler (HTTP 400, the server keeps serving).

A prompt of zero tokens has no position to compute the first output token from. SGLang refuses
one shape of it itself: ``input_ids: []`` raises ``ValueError("input_ids cannot be empty.")`` in
``GenerateReqInput.normalize_batch_and_arguments``, which every entry point (``/generate``, the
OpenAI API, ``Engine.generate``) turns into a 400 answer. Every other shape (``text: ""``,
``text: [..., ""]``, ``input_ids: [[5, 6], []]``, ``input_embeds`` with an empty item) passes and
reaches the model worker, where a zero-length extend kills the scheduler and with it the server.

Two BEFORE hooks on SGLang's own validation close that gap, applied in the process that runs the
tokenizer manager (the launcher):

- :func:`before_normalize` on ``GenerateReqInput.normalize_batch_and_arguments``: the shapes above,
  refused where SGLang refuses ``input_ids: []``, before anything is tokenized or sent to the
  scheduler (a batch with one empty item sends none of its items);
- :func:`before_validate_one` on ``TokenizerManager._validate_one_request``: a prompt that is
  still empty once tokenized (a non-empty text the tokenizer maps to no token, a multimodal
  processor that produced none).

Both raise ``ValueError``, the exception SGLang's HTTP and OpenAI layers answer with 400. They
leave alone what SGLang lets through on purpose: a request continuing a session
(``session_params`` with an ``id``: the session supplies the prompt) and, in the first hook, a
multimodal request (an audio-only prompt may have empty text; the processor makes the ids).
"""

from __future__ import annotations

from typing import Any


def before_normalize(obj: Any, *args: Any, **kwargs: Any) -> None:
    if _continues_session(obj) or _has_mm_input(obj):
        return
    # The prompt SGLang tokenizes: input_ids when given (text then only sizes the batch), else
    # text; input_embeds only when neither is given (normalization drops it otherwise).
    for field in ("input_ids", "text", "input_embeds"):
        value = getattr(obj, field, None)
        if value is not None:
            where = _empty_prompt(field, value)
            if where:
                raise ValueError(f"{where}: a prompt needs at least one token.")
            return


def before_validate_one(manager: Any, obj: Any, input_ids: Any = None, *a: Any, **kw: Any) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    if input_ids is None:
        input_ids = kw.get("input_ids")
    if not isinstance(obj, GenerateReqInput) or input_ids is None or _continues_session(obj):
        return
    if len(input_ids) == 0:
        raise ValueError("the prompt has no tokens once tokenized: a prompt needs at least one.")


def _empty_prompt(field: str, value: Any) -> str | None:
    """Where ``value`` (raw ``text`` / ``input_ids`` / ``input_embeds``) holds an empty prompt."""
    if isinstance(value, str):
        return f"{field} is empty" if not value else None
    if not isinstance(value, (list, tuple)):
        return None
    if not value:
        # input_ids: [] is SGLang's own refusal ("input_ids cannot be empty."); keep its words.
        return None if field == "input_ids" else f"{field} is empty"
    batch = field != "input_ids" or isinstance(value[0], (list, tuple))
    if batch:  # text: one prompt per item; input_embeds: any empty row is malformed
        for i, item in enumerate(value):
            if isinstance(item, (str, list, tuple)) and len(item) == 0:
                return f"{field}[{i}] is empty"
    return None


def _continues_session(obj: Any) -> bool:
    params = getattr(obj, "session_params", None)
    if isinstance(params, dict):
        return bool(params.get("id"))
    return params is not None and bool(getattr(params, "id", None))


def _has_mm_input(obj: Any) -> bool:
    check = getattr(obj, "contains_mm_input", None)
    return bool(check()) if callable(check) else False
