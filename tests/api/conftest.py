"""In-process HTTP fixtures: the real app (store, gateway, router) over the fake backend (echoes)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import pytest

from api.app import init
from testing.fake_backend import FakeBehaviour, fake_backends
from tests.api.helpers import THINKING_TEMPLATE, echo_settings, native_settings


@pytest.fixture
def make_client(aiohttp_client, tmp_path, tiny_model_dir) -> Callable:
    num_made = 0

    async def make(*extra: str, behaviour: FakeBehaviour | None = None):
        # One server per database (store/lock.py): a second client in a test gets its own file.
        nonlocal num_made
        num_made += 1
        if num_made > 1 and not any(item.startswith("store.path=") for item in extra):
            extra = (*extra, f'store.path="{tmp_path / f"chat-{num_made}.db"}"')
        factory = fake_backends(behaviour or FakeBehaviour())
        app = init(echo_settings(tmp_path, tiny_model_dir, extra), backend_factory=factory)
        return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})

    return make


@pytest.fixture
async def native_client(aiohttp_client, tmp_path, tiny_model_dir):
    """The real app over the native engine on the tiny model (`tiny`), safety off."""
    return await aiohttp_client(
        init(native_settings(tmp_path, tiny_model_dir)), server_kwargs={"handler_cancellation": True}
    )


@pytest.fixture
def thinking_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with a reasoning template (THINKING_TEMPLATE)."""
    target = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    return target
