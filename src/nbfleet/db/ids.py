"""Id generation for new rows: the impure half of ``model.ids``."""

from __future__ import annotations

import os
import time

from nbfleet.model.ids import encode_id


def new_id(kind: str) -> str:
    return encode_id(kind, time.time_ns() // 1_000_000, os.urandom(10))
