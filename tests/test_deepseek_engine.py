"""The engine with MLA models: prefix cache on == off (hits whose context lives only in the latent cache),
batch invariance over steps that mix expanded prefill chunks with absorbed decode rows, preemption, abort,
every block back after each scenario, MTP layers in a checkpoint skipped, and the random presets."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from deepseek_factory import make_deepseek_checkpoint
from model_factory import shared_prefix_prompts
from safetensors.torch import load_file, save_file

from lamina import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NAMES = ["deepseek_v3", "deepseek_v2"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smol_tokenizer):
    root = tmp_path_factory.mktemp("deepseek_engine")
    return {n: make_deepseek_checkpoint(root / n, n, smol_tokenizer, seed=10 + i) for i, n in enumerate(NAMES)}


def prompts(n: int = 10, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    lens = [3, 60, 1, 37] + [rng.randrange(2, 60) for _ in range(n - 4)]
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(k)]} for k in lens]


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 16,
          "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    return eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running \
        and not eng.scheduler.waiting and not eng.groups


_ALONE: dict[str, list[list[int]]] = {}


def alone(ckpts, name: str) -> list[list[int]]:
    """Each request's greedy output, run one at a time."""
    if name not in _ALONE:
        llm = make(ckpts[name])
        _ALONE[name] = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]
        assert all_free(llm)
    return _ALONE[name]


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariance_with_chunked_prefill(ckpts, name):
    # A 16-token budget: prefill chunks of several sequences and decode tokens share each forward.
    llm = make(ckpts[name], max_num_batched_tokens=16)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone(ckpts, name)
    assert all_free(llm)


@pytest.mark.parametrize("name", NAMES)
def test_preemption_gives_identical_outputs(ckpts, name):
    # 24 blocks of 4 tokens cannot hold 10 sequences of up to 76 tokens: the scheduler must preempt.
    llm = make(ckpts[name], num_kv_blocks=24, max_num_batched_tokens=32)
    eng = llm.engine
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), p, GREEDY)
    seqs = [g.seqs[0] for g in eng.groups.values()]
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == alone(ckpts, name)
    assert all_free(llm)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_cache_on_equals_off(ckpts, name):
    groups = shared_prefix_prompts(2, per_group=3)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    off = make(ckpts[name], enable_prefix_caching=False).generate(groups, params, use_tqdm=False)
    on = make(ckpts[name], enable_prefix_caching=True, max_num_batched_tokens=9)
    for _ in range(2):  # the second round hits the cache for every prefix
        outs = on.generate(groups, params, use_tqdm=False)
        for a, b in zip(outs, off):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
                assert abs(la[t].logprob - lb[t].logprob) <= 1e-4
    assert on.engine.prefix_cache.hit_tokens > 0
    assert all_free(on)


def test_abort_returns_every_block(ckpts):
    llm = make(ckpts["deepseek_v3"], max_num_batched_tokens=8)
    eng = llm.engine
    for i, p in enumerate(prompts(6)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        eng.step()
    for i in range(6):
        eng.abort_request(str(i))
    while eng.has_unfinished_requests():
        eng.step()
    assert all_free(llm)


def test_mtp_layers_in_the_checkpoint_are_skipped(ckpts, tmp_path):
    # DeepSeek-V3 checkpoints append their multi-token-prediction module as layer num_hidden_layers.
    src = ckpts["deepseek_v3"]
    dst = tmp_path / "with_mtp"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update({k.replace("model.layers.2.", "model.layers.3."): v.clone()
                    for k, v in tensors.items() if k.startswith("model.layers.2.")})
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    p = prompts(1)[0]
    assert make(dst).generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        make(src).generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_tiny_random_preset_generates():
    llm = LLM(model="random:tiny-deepseek-v3", dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              progress=False, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": list(range(5, 40))}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    assert all_free(llm)


def test_presets_describe_the_families():
    from lamina.models.presets import preset_config
    from lamina.models.registry import config_from_hf

    lite = config_from_hf(preset_config("deepseek-v2-lite"))
    assert lite.family == "deepseek_v2" and lite.mla.q_lora_rank is None and lite.mla.kv_lora_rank == 512
    assert [s.ffn for s in lite.layers[:2]] == ["dense", "moe"] and lite.moe.num_experts == 64
    v3 = config_from_hf(preset_config("deepseek-v3-5l"))
    assert v3.family == "deepseek_v3" and v3.moe.topk_method == "noaux_tc" and v3.moe.n_group == 8
    assert v3.rope_scaling["rope_type"] == "yarn"


def test_lamina_verify_passes_on_a_random_deepseek_v3(ckpts):
    from test_verify import run_verify

    r = run_verify([str(ckpts["deepseek_v3"]), "--max-tokens", "8"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("PASS: ")


@pytest.mark.parametrize("wrong", [False, True])
def test_speculative_verify_steps_keep_greedy_outputs(ckpts, wrong):
    # Verify steps score 1 + k tokens per sequence through the expanded form; right drafts are all accepted,
    # wrong ones all rejected (their latent rows roll back and are overwritten).
    from spec.spec_helpers import OracleProposer, with_proposer

    ps = prompts(5, seed=2)
    want = [o.outputs[0].token_ids for o in make(ckpts["deepseek_v3"]).generate(ps, GREEDY, use_tqdm=False)]
    proposer = OracleProposer(ps, want, wrong=wrong)
    llm = with_proposer(make(ckpts["deepseek_v3"], max_num_batched_tokens=24), proposer, 3)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats()
    assert proposer.calls > 0 and stats.num_spec_draft_tokens > 0
    assert (stats.num_spec_accepted_tokens == 0) == wrong
    assert all_free(llm)
