"""One `kvconnect serve --model tiny` behind a router, shared by the API modules of this folder
that need nothing else of an instance (each pytest-xdist worker starts it once at most, when
the first of them runs): their requests are independent of what the others sent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving import RouterProcess, Serve, serve_behind_router


@pytest.fixture(scope="session")
def tiny_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, RouterProcess]]:
    with serve_behind_router(
        tmp_path_factory.mktemp("tiny-api"), "--enable-prompt-tokens-details"
    ) as both:
        yield both
