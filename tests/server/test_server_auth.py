"""--api-key: /v1 and the tokenizer routes need 'Authorization: Bearer KEY'; /health and /metrics stay open.

The secured app runs in-process around the shared engine (no second model load); the flags are checked
through the CLI parser.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest
from server_helpers import MODEL, serve_in_thread

from lamina.cli import build_parser
from lamina.server.app import build_app, make_state

KEY = "sk-lamina-test"


@dataclass
class Secured:
    base_url: str

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


@pytest.fixture(scope="module")
def secured(llm_engine):
    args = build_parser().parse_args(["serve", MODEL, "--port", "0", "--api-key", KEY,
                                      "--served-model-name", "tiny", MODEL])
    assert args.api_key == KEY and args.served_model_name == ["tiny", MODEL] and args.model == MODEL
    with serve_in_thread(build_app(make_state(llm_engine, args.served_model_name, args.api_key))) as base:
        yield Secured(base)


@pytest.mark.parametrize("key", [None, "wrong", KEY + "x"])
def test_rejected_without_the_key(secured, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("POST", "/tokenize", {"prompt": "x"})]:
        r = httpx.request(method, secured.base_url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    # Authentication comes before validation: even a malformed body is a 401, not a 400.
    r = httpx.post(secured.base_url + "/v1/completions", content=b"{", headers=headers)
    assert r.status_code == 401


def test_openai_client_with_and_without_key(secured):
    bad = openai.OpenAI(base_url=secured.api_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    good = openai.OpenAI(base_url=secured.api_url, api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny", MODEL]
    for name in ("tiny", MODEL):  # every served name is accepted
        r = good.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert r.model == "tiny" and r.usage.completion_tokens >= 1


def test_open_routes(secured):
    assert httpx.get(secured.base_url + "/health").status_code == 200
    r = httpx.get(secured.base_url + "/metrics")
    assert r.status_code == 200 and "lamina:num_requests_running" in r.text
