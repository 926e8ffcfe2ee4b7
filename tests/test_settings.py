"""Config loading: defaults, overrides, errors naming the key, and docs for every key."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from api.startup import check_model_folders
from scripts import gen_config
from settings import PROJECT_DIR, ConfigError, Settings, load_settings, settings_help, validate

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
    # The comments come from each setting's help text; edit settings/, then run the script.
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


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.max_num_batched_tokens=0", "engine.max_num_batched_tokens must be 1 or more; got 0"),
        ("engine.max_num_seqs=0", "engine.max_num_seqs must be 1 or more"),
        ("engine.block_size=0", "engine.block_size must be 1 or more"),
        ("engine.speculative_tokens=-1", "engine.speculative_tokens must be 0 or more"),
        ("engine.kv_cache_memory_fraction=1.5", "engine.kv_cache_memory_fraction must be more than 0 and at most 1"),
        ("engine.device=tpu", "engine.device must be one of auto, cpu, cuda, cuda:N; got 'tpu'"),
        ("server.max_connections=0", "server.max_connections must be 1 or more"),
        ("server.port=70000", "server.port must be 0 to 65535"),
        ("server.max_body_bytes=-1", "server.max_body_bytes must be 1 or more"),
        ("server.shutdown_grace_s=-1", "server.shutdown_grace_s must be 0 or more"),
        ("server.heartbeat_s=0", "server.heartbeat_s must be more than 0"),
        ("server.body_timeout_s=-5", "server.body_timeout_s must be more than 0"),
        ('server.log_level="verbose"', "server.log_level must be one of debug, info, warning, error; got 'verbose'"),
        ("store.purge_interval_s=0", "store.purge_interval_s must be 1 or more"),
        ("store.purge_interval_s=-3", "store.purge_interval_s must be 1 or more"),
        ("store.purge_interval_s=nan", "store.purge_interval_s: expected a finite number"),
        ("store.busy_timeout_ms=-1", "store.busy_timeout_ms must be 0 or more"),
        ("store.num_read_connections=0", "store.num_read_connections must be 1 or more"),
        ("store.key_cache_s=-1", "store.key_cache_s must be 0 or more"),
        ("store.synchronous=FAST", "store.synchronous must be one of OFF, NORMAL, FULL, EXTRA; got 'FAST'"),
        ("files.max_file_bytes=-1", "files.max_file_bytes must be 1 or more"),
        ("images.max_image_bytes=0", "images.max_image_bytes must be 1 or more"),
        ("images.max_images_per_request=-1", "images.max_images_per_request must be 0 or more"),
        ("safety.threshold=1.5", "safety.threshold must be 0 to 1"),
        ("safety.thresholds={malware=-0.1}", "safety.thresholds.malware must be 0 to 1"),
        ('safety.block_mode="silent"', "safety.block_mode must be one of refusal, error; got 'silent'"),
        ("queue.max_waiting_requests=-1", "queue.max_waiting_requests must be 0 or more"),
        ("queue.max_wait_s=-1", "queue.max_wait_s must be 0 or more"),
        ("upstream.max_attempts=0", "upstream.max_attempts must be 1 or more"),
        ('embeddings.dtype="bogus"', "embeddings.dtype must be one of float32, bfloat16, int8, w8a8; got 'bogus'"),
        ("tiers.free.max_tokens=0", "tiers.free.max_tokens must be 1 or more"),
        ("models.m.price_output_per_mtok=-1", "models.m.price_output_per_mtok must be 0 or more"),
    ],
)
def test_a_value_outside_what_a_setting_allows_is_a_config_error_naming_it(override, message):
    with pytest.raises(ConfigError) as info:
        load_settings(ROOT / "config.toml", [override])
    assert str(info.value) == message or str(info.value).startswith(message)


def test_the_defaults_and_the_shipped_config_are_allowed_values_and_cases_and_cuda_n_pass():
    assert validate(Settings()) == Settings()
    load_settings(ROOT / "config.toml")
    s = load_settings(None, ['engine.device="cuda:1"', 'store.synchronous="normal"', 'server.log_level="DEBUG"'])
    assert s.engine.device == "cuda:1" and s.store.synchronous == "normal"


def test_every_allowed_range_is_stated_in_the_help_text():
    rows = {key: help_text for key, _default, help_text in settings_help()}
    assert rows["server.port"].endswith("Allowed: 0 to 65535.")
    assert rows["store.purge_interval_s"].endswith("Allowed: 1 or more.")


def test_the_port_flag_is_checked_like_the_setting():
    import server

    args = server.parse_args(["--port", "70000"])
    with pytest.raises(ConfigError, match=r"server\.port must be 0 to 65535"):
        server.apply_cli(load_settings(None), args)


def test_the_model_flag_keeps_the_settings_of_the_model_it_serves_and_refuses_sets_of_others(tmp_path):
    """--model built its model from its path alone: `--set models.<name>.max_model_len=512` and the
    config file's section of that name were dropped without a word."""
    import server

    folder = tmp_path / "my-llama"
    config = write(tmp_path, '[models.my-llama]\nprice_output_per_mtok = 2.0\nfallback = "other"\n[models.other]\n')
    args = server.parse_args(["--model", str(folder), "--set", "models.my-llama.max_model_len=512"])
    settings = server.apply_cli(load_settings(config, args.overrides), args)
    assert list(settings.models) == ["my-llama"]
    served = settings.models["my-llama"]
    assert (served.max_model_len, served.price_output_per_mtok) == (512, 2.0)
    assert (served.path, served.fallback) == (str(folder), "")  # the other models are not served
    for item, message in [
        ("models.other.max_model_len=512", "--model serves one model, named 'my-llama'"),
        ("models.my-llama.path=/elsewhere", "the model's path is --model's"),
    ]:
        args = server.parse_args(["--model", str(folder), "--set", item])
        with pytest.raises(ConfigError, match=re.escape(message)):
            server.apply_cli(load_settings(config, args.overrides), args)


def test_a_copied_config_naming_the_shipped_web_ui_and_models_relatively_still_finds_them(tmp_path):
    """config.toml says static_dir = "static": a copy elsewhere served a 404 UI without a word."""
    copy = tmp_path / "etc" / "config.toml"
    copy.parent.mkdir()
    copy.write_text((ROOT / "config.toml").read_text(encoding="utf-8"))
    settings = load_settings(copy)
    assert settings.server.static_dir == str(PROJECT_DIR / "static")
    assert settings.safety.classifier_path == str(PROJECT_DIR / "safety" / "classifier.npz")
    (copy.parent / "static").mkdir()  # one of the operator's own beside the copy wins
    assert load_settings(copy).server.static_dir == str(copy.parent / "static")
    assert load_settings(copy).store.path == str(copy.parent / "data" / "chat.db")  # data stays beside the copy
    # So do the bundled models it names ("models/demo-flagship"): the start stopped with
    # "the folder .../etc/models/demo-flagship does not exist" (the README says: start from a copy).
    assert settings.models["demo-flagship"].path == str(PROJECT_DIR / "models" / "demo-flagship")
    check_model_folders(settings)
    (copy.parent / "models" / "demo-mini").mkdir(parents=True)  # the operator's own beside the copy wins
    assert load_settings(copy).models["demo-mini"].path == str(copy.parent / "models" / "demo-mini")


def test_a_leading_tilde_in_any_path_setting_or_path_flag_is_the_home_folder(tmp_path, monkeypatch):
    """`~/chat.db` in a config file, in --set or in `--db=~/x` (which the shell leaves alone) made a
    folder named ~ in the working directory, where `rm -rf ~` is one typo from the home folder."""
    import server

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    config = write(tmp_path, '[store]\npath = "~/chat.db"\n[models.m]\npath = "~/models/m"\n[files]\ndir = "~/files"\n')
    settings = load_settings(config, ['server.tls_cert_file="~/cert.pem"', 'models.n.path="~/models/n"'])
    assert settings.store.path == str(home / "chat.db") and settings.files.dir == str(home / "files")
    assert settings.models["m"].path == str(home / "models" / "m")
    assert settings.models["n"].path == str(home / "models" / "n")
    assert settings.server.tls_cert_file == str(home / "cert.pem")
    assert load_settings(None, ["store.path=~/other.db"]).store.path == str(home / "other.db")
    args = server.parse_args(["--db=~/x.db", "--model=~/models/x", "--config=~/c.toml"])
    assert args.config == home / "c.toml" and args.model == home / "models" / "x"
    assert server.apply_cli(load_settings(None), args).store.path == str(home / "x.db")
    assert server.parse_args(["keys", "list", "--db=~/x.db"]).db == str(home / "x.db")


def test_tls_files_and_the_prefix_cache_folder_are_read_from_the_config_files_folder(tmp_path, monkeypatch):
    """store.path was read from the config file's folder but the TLS files and prefix_cache_dir from
    the working directory: the same config started from another folder found no certificate."""
    home, etc, elsewhere = tmp_path / "home", tmp_path / "etc", tmp_path / "elsewhere"
    etc.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    config = etc / "c.toml"
    config.write_text(
        '[server]\ntls_cert_file = "certs/cert.pem"\ntls_key_file = "~/key.pem"\n'
        '[store]\npath = "data/chat.db"\n[engine]\nprefix_cache_dir = "cache"\n'
    )
    settings = load_settings(config)
    assert settings.store.path == str(etc / "data" / "chat.db")
    assert settings.server.tls_cert_file == str(etc / "certs" / "cert.pem")
    assert settings.server.tls_key_file == str(home / "key.pem")
    assert settings.engine.prefix_cache_dir == str(etc / "cache")
    for word in ("auto", ""):  # not paths: beside the database, and not kept
        config.write_text(f'[engine]\nprefix_cache_dir = "{word}"\n')
        assert load_settings(config).engine.prefix_cache_dir == word
    assert load_settings(config, ["engine.prefix_cache_dir=cache"]).engine.prefix_cache_dir == "cache"  # --set: cwd


def test_a_config_file_that_cannot_be_read_as_toml_is_one_config_error_and_a_bom_is_accepted(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_settings(tmp_path)
    utf16 = tmp_path / "utf16.toml"
    utf16.write_text("[server]\nport = 9000\n", encoding="utf-16")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_settings(utf16)
    with_bom = tmp_path / "bom.toml"
    with_bom.write_text("[server]\nport = 9000\n", encoding="utf-8-sig")  # as Notepad saves UTF-8
    assert load_settings(with_bom).server.port == 9000
    for text in ("models = 5\n", 'models = "x"\n', "tiers = 5\n"):
        with pytest.raises(ConfigError, match="expected a table of named sections"):
            load_settings(write(tmp_path, text))


@pytest.mark.parametrize(
    "host, message",
    [
        ("", "server.host must not be empty"),
        ("[::1]", "server.host must be an address or host name alone"),
        ("127.0.0.1:9000", "without brackets, scheme or port (the port is server.port, --port); got '127.0.0.1:9000'"),
        ("http://localhost", "server.host must be an address or host name alone"),
    ],
)
def test_a_host_that_is_empty_or_carries_brackets_or_a_port_is_refused_saying_what_to_give(host, message):
    """--host "" listened on every interface and printed "Open http://:8000"; "[::1]" and
    "127.0.0.1:9000" ended in "Name or service not known"."""
    import server

    with pytest.raises(ConfigError, match=re.escape(message)):
        server.apply_cli(load_settings(None), server.parse_args(["--host", host]))
    for good in ("::1", "0.0.0.0", "localhost", "127.0.0.1"):
        assert server.apply_cli(load_settings(None), server.parse_args(["--host", good])).server.host == good


def test_a_model_folder_given_by_a_symlink_or_from_the_hub_cache_is_served_by_its_own_name(tmp_path):
    """Named after the symlink's target or the snapshot's commit, a model was called '3a1b...'."""
    import server

    target = tmp_path / "store" / "weights-v2"
    target.mkdir(parents=True)
    (tmp_path / "my-llama").symlink_to(target)
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "3a1b2c"
    snapshot.mkdir(parents=True)
    for folder, name in ((tmp_path / "my-llama", "my-llama"), (snapshot, "Qwen3-0.6B"), (target / "..", "store")):
        settings = server.apply_cli(load_settings(None), server.parse_args(["--model", str(folder)]))
        assert list(settings.models) == [name]


@pytest.mark.parametrize(
    "url", ["chat.example.com", "https://chat.example.com/chat", "ftp://chat.example.com", "https://u@chat.example.com"]
)
def test_a_public_base_url_must_be_an_origin_alone(url):
    """Links are /share/<token> of it and their page reads /static/ and /v1/ from its root: a path
    there names pages nobody serves, and no scheme or a user gives links that do not open."""
    with pytest.raises(ConfigError, match=re.escape("sharing.public_base_url must be empty or an origin alone")):
        load_settings(None, [f'sharing.public_base_url="{url}"'])
    for good in ("", "https://chat.example.com", "http://10.0.0.5:8000/", "http://[::1]:8000"):
        assert load_settings(None, [f'sharing.public_base_url="{good}"']).sharing.public_base_url == good
