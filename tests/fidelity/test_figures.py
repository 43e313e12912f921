"""Real notebooks suspended and resumed at three cut points each (the ``figures``
group of ``harness.GROUPS``; sources in ``notebooks/SOURCES.md``)."""

from __future__ import annotations

import pytest

from tests.fidelity.harness import group_test

#: Real kernels and files only: the PostgreSQL pass of `make test` skips it.
pytestmark = [pytest.mark.no_db, pytest.mark.timeout(600)]

test_a_resumed_notebook_carries_on_as_if_it_never_stopped = group_test("figures")
