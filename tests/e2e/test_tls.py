"""HTTPS served directly (server.tls_cert_file / tls_key_file): the server process answers over
TLS with its certificate (the self-signed test certificate in testing/tls, for 127.0.0.1 and
localhost), plain HTTP on that port gets no answer, and unusable settings stop the start with
the setting named."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.request

import pytest

from api.security import tls_context
from settings import ConfigError, load_settings
from testing.fake_backend import FakeBehaviour
from testing.server_proc import ROOT, ServerProcess

CERT = ROOT / "testing" / "tls" / "cert.pem"
KEY = ROOT / "testing" / "tls" / "key.pem"


def tls_args(cert=CERT, key=KEY) -> list[str]:
    return ["--set", f'server.tls_cert_file="{cert}"', "--set", f'server.tls_key_file="{key}"']


@pytest.mark.slow
def test_the_server_answers_over_https_and_not_over_plain_http(tiny_model_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--db", str(tmp_path / "chat.db"), *tls_args()]
    with ServerProcess(args, fake=FakeBehaviour(), cafile=CERT, log_path=tmp_path / "server.log") as server:
        assert server.base_url.startswith("https://")
        with server.urlopen(server.base_url + "/v1/models") as resp:
            assert resp.status == 200 and json.loads(resp.read())["data"]
        body = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "hello over tls"}]}
        req = urllib.request.Request(
            server.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with server.urlopen(req) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == "hello over tls"  # the fake echoes
        # A client that does not trust the certificate is refused by its own TLS check.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(server.base_url + "/health", timeout=5)
        # Plain HTTP on the TLS port: no HTTP answer.
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            conn.request("GET", "/health")
            conn.getresponse()
        conn.close()
        assert "https://127.0.0.1" in (tmp_path / "server.log").read_text()  # the ready line names the scheme


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ([f'server.tls_cert_file="{CERT}"'], "go together"),
        ([f'server.tls_key_file="{KEY}"'], "go together"),
        (['server.tls_cert_file="/nonexistent/cert.pem"', f'server.tls_key_file="{KEY}"'], "/nonexistent/cert.pem"),
        ([f'server.tls_cert_file="{KEY}"', f'server.tls_key_file="{CERT}"'], "cannot load"),
    ],
)
def test_unusable_tls_settings_are_a_config_error_naming_them(sets, message):
    with pytest.raises(ConfigError, match=message):
        tls_context(load_settings(None, sets))


def test_the_context_needs_tls_1_2_or_later():
    context = tls_context(load_settings(None, [f'server.tls_cert_file="{CERT}"', f'server.tls_key_file="{KEY}"']))
    assert context is not None and context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert tls_context(load_settings(None, [])) is None
