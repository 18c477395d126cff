"""The start-up warm-up (engine/warmup.py): it returns every block and slot, leaves the prefix-cache
statistics at zero, and changes no later output, greedy or sampled from the engine's own generator."""
from __future__ import annotations

import random

import pytest
from hybrid_helpers import make_hybrid_checkpoint

from lamina import LLM, SamplingParams
from lamina.engine.warmup import warmup_requests

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True)  # unseeded

pytestmark = pytest.mark.usefixtures("one_thread")


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 512, "max_num_seqs": 16,
          "max_num_batched_tokens": 128, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def prompts(n: int = 6) -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    pool = eng.state_pool
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups and not eng.scheduler.running
            and not eng.scheduler.waiting and (pool is None or pool.num_free == pool.num_slots))


def test_rounds_cover_prompt_sizes_up_to_one_step():
    rounds = warmup_requests(8192, 40000, 256, 151936)
    singles = [len(r[0][0]) for r in rounds if len(r) == 1]
    assert singles == [16, 64, 256, 1024, 4096, 8192]
    many = rounds[-1]
    assert len(many) == 64 and len({len(p) for p, _ in many}) > 10
    assert all(p.seed is not None or p.temperature == 0 for _, p in many)  # never the engine's generator
    assert all(0 <= t < 151936 for r in rounds for p, _ in r for t in p)
    short = warmup_requests(2048, 100, 4, 1000)  # a short max_model_len bounds every prompt
    assert all(len(p) <= 92 for r in short for p, _ in r) and len(short[-1]) == 4


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_warmup_frees_everything_and_changes_no_output(family, checkpoints, smol_tokenizer, tmp_path_factory):
    if family == "llama":
        path = checkpoints["llama"]
    else:
        path = make_hybrid_checkpoint(tmp_path_factory.mktemp("warm") / family, family, smol_tokenizer, seed=5)
    cold = make(path, warmup=False)
    warm = make(path, warmup=True)
    assert all_free(warm)
    assert cold.engine.allocator.num_cached == 0 < warm.engine.allocator.num_cached  # it did run requests
    stats = warm.engine.stats()
    assert stats.num_prefix_queried_tokens == 0 and stats.num_snapshot_hits == 0
    for params in (GREEDY, SAMPLED):
        a = [o.outputs[0].token_ids for o in cold.generate(prompts(), params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in warm.generate(prompts(), params, use_tqdm=False)]
        assert a == b
    assert all_free(warm)
