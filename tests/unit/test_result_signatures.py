"""Signed result URLs: any text in the signature is answered with 403, never an error."""

from __future__ import annotations

import pytest

from nbfleet.jobs.results import check, sign, signing_key
from nbfleet.model.errors import Forbidden

KEY = signing_key("cluster secret")
JOB, ATTEMPT, NAME, EXPIRES = "job_01", 1, "video.mp4", 2_000_000_000


def test_the_right_signature_passes() -> None:
    check(KEY, JOB, ATTEMPT, NAME, EXPIRES, sign(KEY, JOB, ATTEMPT, NAME, EXPIRES), 0.0)


@pytest.mark.parametrize("signature", [
    "",
    "0" * 64,
    "é" * 64,  # not ASCII: compare_digest would raise TypeError on str
    "\u0000",
    "🎉",
    "\udc80",  # a lone surrogate cannot even be encoded
    sign(KEY, JOB, ATTEMPT, NAME, EXPIRES).upper(),
    sign(KEY, JOB, ATTEMPT, NAME, EXPIRES)[:-1] + "é",
    sign(KEY, JOB, ATTEMPT, NAME, EXPIRES) + "0",
])
def test_any_other_text_is_forbidden(signature: str) -> None:
    with pytest.raises(Forbidden, match="invalid signature"):
        check(KEY, JOB, ATTEMPT, NAME, EXPIRES, signature, 0.0)
