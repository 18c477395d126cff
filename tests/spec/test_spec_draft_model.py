"""draft_model: a separate model with the target's vocabulary drafts with its own KV pool. Greedy outputs are
the target's exactly (a different drafter: some drafts stand; the target itself as drafter: all stand), with
preemption and chunked prefill; the drafter's blocks all go back; a drafter with another vocabulary is
refused at start-up with one line."""
from __future__ import annotations

import pytest
from model_factory import SMALL
from spec_helpers import GREEDY64, all_free, make, outputs, spec_prompts


@pytest.fixture(scope="module")
def plain(checkpoints, one_thread):
    ps = spec_prompts(5, seed=11)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


def _cfg(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}


@pytest.mark.parametrize("drafter", ["itself", "qwen2"])
@pytest.mark.parametrize("scenario", [{}, {"num_kv_blocks": 40}, {"max_num_batched_tokens": 16}],
                         ids=["plain", "preemption", "chunked"])
def test_draft_model_greedy_identical(checkpoints, plain, drafter, scenario):
    ps, ref = plain
    path = checkpoints["llama"] if drafter == "itself" else checkpoints["qwen2"]
    llm = make(checkpoints["llama"], speculative_config=_cfg(path), **scenario)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_draft_tokens > 0
    if drafter == "itself":
        assert st.num_spec_accepted_tokens == st.num_spec_draft_tokens
    assert all_free(llm)
    prop = llm.engine.spec.proposer
    prop._gc()
    assert prop.allocator.num_free == prop.allocator.num_blocks and not prop.seqs


def test_other_vocabulary_refused(checkpoints, tmp_path, smol_tokenizer):
    import transformers

    other = tmp_path / "small_vocab"
    cfg = transformers.LlamaConfig(**SMALL, vocab_size=1000)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    smol_tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary") as e:
        make(checkpoints["llama"], speculative_config=_cfg(other))
    assert "\n" not in str(e.value)
