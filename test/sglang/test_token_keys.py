"""Token ids become the same int32 key bytes on every path, and an id that does not fit is an
error on every path (``index.keys.pack_tokens`` and the binding's ``request.token_bytes``)."""

from __future__ import annotations

from array import array

import pytest
import torch

from sglang_hybrid.index.keys import pack_tokens
from sglang_hybrid.sglang.request import token_bytes

IDS = [0, 1, 151_643, 2**31 - 1, -(2**31)]


def test_every_form_of_the_same_ids_packs_to_the_same_bytes() -> None:
    want = pack_tokens(IDS)
    assert (
        token_bytes(IDS) == token_bytes(array("q", IDS)) == token_bytes(torch.tensor(IDS)) == want
    )
    assert token_bytes(array("q", IDS), 1, 4) == pack_tokens(IDS[1:4])


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**40])
def test_an_id_outside_int32_is_refused_not_wrapped(bad: int) -> None:
    ids = [5, bad, 7]
    msg = f"token id {bad} does not fit"
    with pytest.raises(ValueError, match=msg):
        pack_tokens(ids)
    for form in (ids, array("q", ids), torch.tensor(ids)):
        with pytest.raises(ValueError, match=msg):
            token_bytes(form)
