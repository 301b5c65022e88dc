"""Fixtures of the SFS estimator tests."""

from __future__ import annotations

import pytest

from services.estimator.sfs import kernel, native, replay


@pytest.fixture(params=["plain", "native"])
def kernel_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the plain kernel module and on its mypyc build (which
    `./baton install` compiles; skipped where none exists for this kernel.py)."""
    if request.param == "native":
        if not native.NATIVE:
            pytest.skip(native.IMPL_NOTE)
        monkeypatch.setattr(replay, "kernel_impl", native.IMPL)
    else:
        monkeypatch.setattr(replay, "kernel_impl", kernel)
    return str(request.param)
