"""Bad input gets a clear ValueError and leaves the engine serving; plus the block allocator's bookkeeping."""
from __future__ import annotations

import pytest

from lamina import LLM, SamplingParams
from lamina.cache.block_allocator import BlockAllocator, NoFreeBlocks


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(model=str(checkpoints["llama"]), dtype="float32", device="cpu", num_kv_blocks=32, progress=False)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty"),
    ("", "empty"),
    ({"prompt_token_ids": [1, 2, 10**9]}, "token ids"),
    ({"prompt_token_ids": [1, "a"]}, "token ids"),
    ({"text": "x"}, "prompt"),
    (3.5, "prompt"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.allocator.num_free == 32 and not llm.engine.groups
    assert llm.generate("fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_duplicate_request_id(llm):
    eng = llm.engine
    eng.add_request("same", "a", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("same", "b", SamplingParams(max_tokens=2))
    eng.abort_request("same")
    assert eng.allocator.num_free == 32


def test_unknown_model_source():
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM(model="/nonexistent/model", progress=False)


def test_engine_config_validation(checkpoints):
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(checkpoints["llama"]), block_size=3, progress=False)
    with pytest.raises(ValueError, match="does not fit"):
        LLM(model=str(checkpoints["llama"]), device="cpu", num_kv_blocks=4, max_model_len=1000, progress=False)


def test_block_allocator_refcounts():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    a.share(blocks[0])
    a.free(blocks)
    assert a.num_free == 3  # blocks[0] still held by its second owner
    a.free([blocks[0]])
    assert a.num_free == 4
    with pytest.raises(AssertionError):
        a.free([blocks[0]])
    with pytest.raises(NoFreeBlocks):
        a.allocate(5)
