from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def one_blas_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels started by these tests inherit it: a threaded BLAS sums in a varying order."""
    for threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(threads, "1")
