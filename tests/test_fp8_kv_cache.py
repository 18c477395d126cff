"""--kv-cache-dtype fp8 end to end on the CPU path: the pool is sized by its 1-byte entries (twice the tokens
of a bf16 pool in the same memory, four times fp32's), every lease comes back, and logprobs stay close to the
model-dtype cache. The bound is derived like the FP8 weights': e4m3 keeps 4 fewer mantissa bits than bf16, so
its rounding of K and V is 16x a bf16 cache's; we allow 1.5x that, i.e. 24x the logprob error of the same
model with its KV pool in bf16 (measured on these models: 13-14x, 0.24-0.26 nats at most over a 48-token
prompt of a random model whose logprobs are far more peaked than a trained one's)."""
from __future__ import annotations

import pytest
import torch
from test_parity_hf import PROMPT, prompt_logprobs

from lamina import LLM, SamplingParams
from lamina.engine import build

pytestmark = pytest.mark.usefixtures("one_thread")


def make_llm(path, dtype="float32", **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(model=str(path), dtype=dtype, device="cpu", block_size=4, progress=False, **kw)


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_pool_holds_more_tokens_in_the_same_memory(checkpoints, dtype, ratio):
    """Same budget (80 one-byte blocks' worth): the FP8 pool has `ratio` times the blocks, and eight
    sequences that need more blocks than the model-dtype pool holds all run at once in it; every block is
    free again afterwards."""
    path = checkpoints["llama"]
    cfg_bytes = 2 * 2 * 4 * 2 * 16  # layers x (K, V) x block_size x KV heads x head_dim: one block in FP8
    sizes = {}
    for kv in ("auto", "fp8"):
        eng = LLM(model=str(path), dtype=dtype, device="cpu", block_size=4, progress=False, kv_cache_dtype=kv,
                  kv_cache_memory_gb=80 * cfg_bytes / 2**30, enable_prefix_caching=False).engine
        assert {v.k.dtype for v in eng.kv_cache.views} == {torch.float8_e4m3fn if kv == "fp8" else
                                                            getattr(torch, dtype)}
        sizes[kv] = eng.kv_cache.num_blocks
    assert sizes["fp8"] == 80 and sizes["fp8"] == ratio * sizes["auto"]
    need = 8 * -(-(30 + 6) // 4)  # blocks of eight 30-token prompts with 6 new tokens each
    assert sizes["auto"] < need <= sizes["fp8"]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    for i in range(8):
        eng.add_request(f"r{i}", {"prompt_token_ids": PROMPT[i:i + 30]}, params)
    peak_running, done = 0, 0
    while eng.has_unfinished_requests():
        done += sum(o.finished for o in eng.step())
        peak_running = max(peak_running, eng.stats().num_running)
    assert done == 8 and peak_running == 8
    assert eng.allocator.num_free == eng.kv_cache.num_blocks


def test_fp8_kv_logprobs_stay_within_the_rounding_bound(checkpoints, monkeypatch):
    errors = {}
    for family in ("llama", "qwen3"):
        path = checkpoints[family]
        ref = prompt_logprobs(make_llm(path), PROMPT)
        fp8 = prompt_logprobs(make_llm(path, kv_cache_dtype="fp8", max_num_batched_tokens=7), PROMPT)  # chunked
        with monkeypatch.context() as m:
            m.setattr(build, "kv_storage_dtype", lambda config: torch.bfloat16)
            bf16 = prompt_logprobs(make_llm(path, max_num_batched_tokens=7), PROMPT)
        errors[family] = ((fp8 - ref).abs().max().item(), (bf16 - ref).abs().max().item())
    for family, (e8, e16) in errors.items():
        assert 0 < e8 <= 24 * e16 + 1e-3, (family, errors)


def test_fp8_kv_decode_within_the_rounding_bound(checkpoints, monkeypatch):
    """Greedy decode through the FP8 cache (each step reads every past K/V from it): each sampled token's
    logprob vs the fp32-cache model scoring the same sequence, within the same 24x-bf16 bound."""
    path = checkpoints["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    reference = make_llm(path)

    def decode_error(**kw) -> float:
        out = make_llm(path, **kw).generate({"prompt_token_ids": PROMPT[:20]}, params, use_tqdm=False)[0].outputs[0]
        ref = prompt_logprobs(reference, PROMPT[:20] + list(out.token_ids))[19:]
        ours = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])
        return (ours - ref).abs().max().item()

    e8 = decode_error(kv_cache_dtype="fp8")
    with monkeypatch.context() as m:
        m.setattr(build, "kv_storage_dtype", lambda config: torch.bfloat16)
        e16 = decode_error()
    assert 0 < e8 <= 24 * e16 + 1e-3, (e8, e16)


def with_kv_scales(src, dst, k_scale: float, v_scale: float, style: str):
    """A copy of checkpoint `src` carrying per-layer KV-cache scales in one of the published namings."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for i in range(2):
        pre = f"model.layers.{i}.self_attn"
        names = {"ct": (f"{pre}.k_scale", f"{pre}.v_scale"),
                 "autofp8": (f"{pre}.k_proj.output_scale", f"{pre}.v_proj.output_scale")}[style]
        tensors[names[0]], tensors[names[1]] = torch.tensor(k_scale), torch.tensor([v_scale])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("family, style", [("llama", "ct"), ("qwen3", "autofp8")])
def test_checkpoint_kv_scales_scale_the_fp8_cache(checkpoints, tmp_path, family, style):
    """k_scale / v_scale from the checkpoint: the FP8 cache holds K/k_scale and V/v_scale (checked against
    the fp32 cache of the same prompt, to e4m3 rounding), logprobs keep the bound, and a model-dtype cache
    ignores them."""
    ks, vs = 0.25, 0.125  # K and V stored 4x and 8x larger: far from both FP8 ends for these models
    path = with_kv_scales(checkpoints[family], tmp_path / family, ks, vs, style)
    ref_llm = make_llm(checkpoints[family])
    ref = prompt_logprobs(ref_llm, PROMPT)
    plain = make_llm(path)
    assert torch.equal(prompt_logprobs(plain, PROMPT), ref)  # scales ignored without an FP8 cache
    fp8 = make_llm(path, kv_cache_dtype="fp8")
    layers = [m for m in fp8.engine.model.modules() if hasattr(m, "set_kv_scales")]
    assert [m.kv_scales for m in layers] == [(ks, vs)] * 2
    ours = prompt_logprobs(fp8, PROMPT)
    # Layer 0's K and V depend on the embeddings alone (later layers see the rounding of earlier ones).
    for view, ref_view in zip(fp8.engine.kv_cache.views[:1], ref_llm.engine.kv_cache.views[:1]):
        for got, want, s in ((view.k, ref_view.k, ks), (view.v, ref_view.v, vs)):
            used = want.abs().sum(dim=(1, 2, 3)) > 0  # blocks the prompt wrote (the same ids in both runs)
            g, w = got[used].float() * s, want[used]
            assert ((g - w).abs() <= w.abs() * 2**-4 + 2**-9 * s).all()
    # 24x the bf16-KV yardstick that test_fp8_kv_logprobs_stay_within_the_rounding_bound measures on these
    # models (0.0185 nats), rounded up.
    assert (ours - ref).abs().max().item() <= 0.5


def test_kv_scales_are_refused_where_they_do_not_fit():
    """A scale on a module that is not an attention layer, or one that is not a single number, is refused."""
    from lamina.models.kv_scales import KVScales
    from lamina.models.weights import Target

    scales = KVScales()
    mapped = scales.wrap(lambda name, t: [(Target(name), t)])
    assert list(mapped("model.layers.0.self_attn.q_scale", torch.tensor(1.0))) == []  # unused, dropped
    assert list(mapped("model.layers.0.mlp.k_scale", torch.tensor(2.0))) == []
    with pytest.raises(ValueError, match="must be one number"):
        list(mapped("model.layers.0.self_attn.v_scale", torch.ones(2)))
    with pytest.raises(ValueError, match="'model.layers.0.mlp', which is not an attention layer"):
        scales.apply(torch.nn.ModuleDict({"x": torch.nn.Linear(1, 1)}))
