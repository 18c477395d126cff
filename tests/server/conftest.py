"""Fixtures of the server tests: one real `lamina serve` process for the session.

Session-scoped because loading the model costs seconds on a 2-core CPU; every test leaves the server idle
again (tests that could leave work behind assert it through wait_idle).
"""
from __future__ import annotations

import pytest
from server_helpers import start_server, stop_server


@pytest.fixture(scope="session")
def server():
    # Prompt-token details on: tests read prefix-cache hits from usage (the default-off shape is tested
    # in-process, test_vllm_extensions.py).
    srv = start_server(["--enable-prompt-tokens-details"])
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def llm_engine():
    """An in-process engine for the AsyncEngine and fault-injection tests (one AsyncEngine at a time)."""
    from server_helpers import MAX_MODEL_LEN, MODEL

    from lamina.config import EngineConfig
    from lamina.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=128), progress=False)
