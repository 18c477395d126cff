"""What a verify step of a hybrid model costs besides its forward, counted at 64 concurrent sequences whose
prompts take several chunks (the H200 run that motivated this: Qwen3-Next-80B shape, 64 sequences, steps of
88-191 ms against an 18-31 ms forward).

Counted, not timed: steps whose drafts sit next to a prompt chunk (on a GPU such a step has no device candidate
table, so the recurrent layers ran the per-token torch reference), state-slot copies outside a forward (the
commit of a candidate state used to copy every state tensor per sequence), and greedy outputs against plain
decoding; every block and state slot is free afterwards."""
from __future__ import annotations

import random

import pytest
from hybrid_helpers import make_hybrid_checkpoint
from spec_helpers import make

from lamina import SamplingParams
from lamina.cache.state_pool import StatePool
from lamina.engine.runner import ModelRunner
from lamina.spec.config import parse_speculative_config

N, PROMPT, OUT = 64, 6, 5


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, smol_tokenizer, one_thread):
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("step_cost") / "qwen3_next", "qwen3_next",
                                  smol_tokenizer, seed=14)


def _prompts() -> list[dict]:
    rng = random.Random(2)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(PROMPT)]} for _ in range(N)]


def _run(llm, counts: dict):
    prepare, copy = ModelRunner.prepare, StatePool.copy_slot

    def counted_prepare(runner, scheduled, *a, **kw):
        batch = prepare(runner, scheduled, *a, **kw)
        state = batch.ctx.state
        if state is not None and state.candidate_slots_cpu is not None:
            counts["verify_steps"] += 1
            counts["without_device_table"] += state.candidate_slots is None
            counts["next_to_prefill"] += any(s.num_tokens != max(s.num_sampled, 1) for s in scheduled)
        return batch

    def counted_copy(pool, src, dst):
        counts["slot_copies"] += 1
        return copy(pool, src, dst)
    ModelRunner.prepare, StatePool.copy_slot = counted_prepare, counted_copy
    try:
        params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
        return [r.outputs[0].token_ids for r in llm.generate(_prompts(), params, use_tqdm=False)]
    finally:
        ModelRunner.prepare, StatePool.copy_slot = prepare, copy


def test_hybrid_verify_steps_at_64_sequences(hybrid_path):
    # 96 tokens a step: the 384 prompt tokens take 4+ steps, the sequences admitted first decode (and draft)
    # next to the later chunks
    kw = {"max_num_seqs": N, "max_num_batched_tokens": 96, "num_kv_blocks": 2048}
    plain = _run(make(hybrid_path, **kw), {k: 0 for k in ("verify_steps", "without_device_table",
                                                            "next_to_prefill", "slot_copies")})
    spec = parse_speculative_config({"method": "replay", "num_speculative_tokens": 3, "acceptance_prob": 0.0,
                                     "forced": True, "min_acceptance_rate": 0}, bench=True)
    llm = make(hybrid_path, speculative_config=spec, **kw)
    llm.engine.spec.proposer.reference.update({tuple(p["prompt_token_ids"]): o for p, o in zip(_prompts(), plain)})
    counts = {k: 0 for k in ("verify_steps", "without_device_table", "next_to_prefill", "slot_copies")}
    assert _run(llm, counts) == plain
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0 and st.num_spec_accepted_tokens == 0  # acceptance 0: every verify rolls back
    assert counts["verify_steps"] >= OUT - 2
    # before the fix: 5 of 10 verify steps sat next to a prompt chunk, and 192 slot copies (one per rollback)
    assert counts["next_to_prefill"] == 0 and counts["without_device_table"] == 0, counts
    assert counts["slot_copies"] == 0, counts
    eng = llm.engine
    assert eng.state_pool.num_free == eng.state_pool.num_slots and eng.allocator.num_free == eng.allocator.num_blocks
