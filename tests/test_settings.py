"""Config loading: defaults, overrides, errors naming the key, and docs for every key."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from scripts import gen_config
from settings import PROJECT_DIR, ConfigError, Settings, load_settings, settings_help

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_bundled_config_loads_with_three_tiers_and_two_models():
    s = load_settings(ROOT / "config.toml")
    assert set(s.tiers) == {"free", "plus", "enterprise"}
    assert s.tiers["free"].models == ["demo-mini"]
    assert s.tiers["plus"].models[0] == "demo-flagship"
    assert s.models["demo-flagship"].fallback == "demo-mini"


def test_no_file_gives_defaults():
    assert load_settings(None) == Settings()


def test_set_overrides_any_key_including_named_sections(tmp_path):
    s = load_settings(
        None, ["engine.max_num_seqs=3", "tiers.gold.priority=9", "server.host=0.0.0.0", 'tiers.gold.models=["a", "b"]']
    )
    assert s.engine.max_num_seqs == 3
    assert s.tiers["gold"].priority == 9 and s.tiers["gold"].models == ["a", "b"]
    assert s.server.host == "0.0.0.0"


@pytest.mark.parametrize(
    "text, key",
    [
        ("[engine]\nbogus = 1\n", "engine.bogus"),
        ("[nope]\n", "nope"),
        ('[engine]\nblock_size = "16"\n', "engine.block_size"),
        ("[engine]\nblock_size = true\n", "engine.block_size"),
        ("[server]\nallow_public_without_keys = 1\n", "server.allow_public_without_keys"),
        ('[tiers.free]\nmodels = "demo"\n', "tiers.free.models"),
        ("[tiers.free]\nwat = 1\n", "tiers.free.wat"),
        ('[models.m]\nprice_input_per_mtok = "cheap"\n', "models.m.price_input_per_mtok"),
    ],
)
def test_unknown_keys_and_wrong_types_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_settings(write(tmp_path, text))


def test_invalid_toml_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        load_settings(write(tmp_path, "[server\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_settings(None, ["novalue"])


def test_every_setting_has_help():
    for key, _default, help_text in settings_help():
        assert help_text.strip(), key


def test_config_toml_is_what_gen_config_writes_from_settings_py():
    # The comments come from each setting's help text; edit settings.py, then run the script.
    assert (ROOT / "config.toml").read_text(encoding="utf-8") == gen_config.render(), (
        "config.toml is stale: run .venv/bin/python -m scripts.gen_config"
    )


def test_config_toml_values_equal_the_defaults_declared_in_settings_py():
    raw = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))
    defaults = dataclasses.asdict(Settings())
    for section, values in defaults.items():
        if section in ("models", "tiers"):
            continue
        assert raw[section] == values, section
    assert set(raw) == set(defaults)


def test_the_shipped_models_and_tiers_load_and_name_only_declared_models():
    s = load_settings(ROOT / "config.toml")
    for name, tier in s.tiers.items():
        assert set(tier.models) <= set(s.models), name
    assert all(m.fallback in ("", *s.models) for m in s.models.values())


def test_relative_paths_in_a_config_file_are_relative_to_its_folder_and_set_to_the_cwd(tmp_path):
    config = tmp_path / "conf" / "config.toml"
    config.parent.mkdir()
    config.write_text(
        '[store]\npath = "data/chat.db"\n[models.m]\npath = "models/m"\n[models.abs]\npath = "/opt/models/abs"\n'
    )
    settings = load_settings(config, ['safety.classifier_path="elsewhere/head.npz"'])
    base = config.parent.resolve()
    assert settings.store.path == str(base / "data" / "chat.db")
    assert settings.models["m"].path == str(base / "models" / "m")
    assert settings.models["abs"].path == "/opt/models/abs"
    # Defaults: the user's data beside the file; what ships with the server, in the project.
    assert settings.server.static_dir == str(PROJECT_DIR / "static")
    settings = load_settings(config)
    assert settings.safety.classifier_path == str(PROJECT_DIR / "safety" / "classifier.npz")
    assert Path(settings.safety.classifier_path).is_file() and Path(settings.server.static_dir).is_dir()
    settings = load_settings(config, ['safety.classifier_path="elsewhere/head.npz"'])
    assert settings.safety.classifier_path == "elsewhere/head.npz"  # --set: as typed
    assert settings.files.dir == ""  # empty keeps its meaning (beside the database)
    assert load_settings(None).store.path == "data/chat.db"  # no file: nothing to resolve against


def test_the_default_body_limit_holds_the_largest_image_sent_inline():
    """Open WebUI and LibreChat send images as data: URLs inside the JSON body; a 1 MiB body
    limit refused any phone photo with 413 although images.max_image_bytes allowed 10 MiB."""
    defaults = Settings()
    base64_chars = -(-defaults.images.max_image_bytes // 3) * 4
    assert defaults.server.max_body_bytes >= base64_chars + 64 * 1024  # and room for the messages
