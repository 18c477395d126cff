"""The engine with hybrid / MoE models: batch invariance over a varlen batch mixing prefill chunks and decode
tokens, preemption, the state-slot limit, and every exit path (finish, abort, preemption, error) returning
both KV blocks and state slots."""
from __future__ import annotations

import random

import pytest
import torch
from hybrid_helpers import FAMILIES, hybrid_checkpoints

from lamina import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NUM_PROMPTS = 12


def prompts(n: int = NUM_PROMPTS, seed: int = 0) -> list[dict]:
    # 3..90 tokens: some shorter than the conv window, some longer than one 64-token delta-rule chunk.
    rng = random.Random(seed)
    lens = [3, 90, 5, 70] + [rng.randrange(3, 90) for _ in range(n - 4)]
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(k)]} for k in lens]


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 16,
          "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    pool = eng.state_pool
    slots_free = pool is None or pool.num_free == pool.num_slots
    return eng.allocator.num_free == eng.allocator.num_blocks and slots_free and not eng.scheduler.running \
        and not eng.scheduler.waiting and not eng.groups


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smol_tokenizer):
    return hybrid_checkpoints(tmp_path_factory, smol_tokenizer)


_ALONE: dict[str, list[list[int]]] = {}


def alone(ckpts, family: str) -> list[list[int]]:
    """Each request's greedy output run alone (one engine, so slots are reused by later requests)."""
    if family not in _ALONE:
        llm = make(ckpts[family])
        _ALONE[family] = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]
        assert all_free(llm)
    return _ALONE[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_invariance_with_chunked_prefill(ckpts, family):
    # A 16-token budget: prefill chunks of several sequences and decode tokens share each forward.
    llm = make(ckpts[family], max_num_batched_tokens=16)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone(ckpts, family)
    assert all_free(llm)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_preemption_gives_identical_outputs(ckpts, family):
    # 30 blocks of 4 tokens cannot hold 12 sequences of up to 106 tokens: the scheduler must preempt, and a
    # preempted sequence restarts from position 0 in a fresh slot.
    llm = make(ckpts[family], num_kv_blocks=30, max_num_batched_tokens=32)
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), p, GREEDY)
    seqs = [g.seqs[0] for g in eng.groups.values()]
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == alone(ckpts, family)
    assert all_free(llm)


def test_no_more_running_sequences_than_slots(ckpts):
    llm = make(ckpts["qwen3_next"], max_num_seqs=3, max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.state_pool.num_slots == 3
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), p, GREEDY)
    seqs = [g.seqs[0] for g in eng.groups.values()]
    while eng.has_unfinished_requests():
        eng.step()
        leased = [s.state_slot for s in eng.scheduler.running]
        assert len(leased) <= 3 and None not in leased and len(set(leased)) == len(leased)
        assert eng.state_pool.num_free == 3 - len(leased)
    assert [s.output_token_ids for s in seqs] == alone(ckpts, "qwen3_next")
    assert all_free(llm)


def test_stale_slot_state_is_never_read(ckpts):
    """A sequence starting at position 0 must not see what its slot's previous tenant (or garbage) left."""
    llm = make(ckpts["qwen3_5"], max_num_batched_tokens=16)
    for conv, ssm in llm.engine.state_pool.tensors:
        conv.normal_(0, 100.0)
        ssm.normal_(0, 100.0)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone(ckpts, "qwen3_5")
    assert all_free(llm)


def test_abort_returns_blocks_and_slots(ckpts):
    llm = make(ckpts["qwen3_5_moe"], max_num_batched_tokens=16)
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.state_pool.num_free < eng.state_pool.num_slots
    for rid in ("2", "0", "3", "1"):
        assert eng.abort_request(rid).outputs[0].finish_reason == "abort"
    assert all_free(llm)


def test_model_error_returns_blocks_and_slots(ckpts, monkeypatch):
    from lamina.models.layers.gated_delta_net import GatedDeltaNet

    llm = make(ckpts["qwen3_next"], max_num_batched_tokens=16)
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, GREEDY)
    eng.step()
    real = GatedDeltaNet.forward

    def broken(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(GatedDeltaNet, "forward", broken)
    outs = eng.step()
    assert outs and all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    monkeypatch.setattr(GatedDeltaNet, "forward", real)
    while eng.has_unfinished_requests():  # whatever was not in the failed step carries on
        eng.step()
    assert all_free(llm)
    # And the engine still serves correctly afterwards, from slots the failed requests left dirty.
    out = llm.generate(prompts()[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == alone(ckpts, "qwen3_next")[:2]
    assert all_free(llm)
