"""In-process HTTP fixtures: the real app (store, gateway, router) over the echo backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from api.app import init
from tests.api.helpers import echo_settings


@pytest.fixture
def make_client(aiohttp_client, tmp_path, tiny_model_dir) -> Callable:
    async def make(*extra: str):
        app = init(echo_settings(tmp_path, tiny_model_dir, extra))
        return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})

    return make
