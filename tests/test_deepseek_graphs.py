"""MLA models under the CUDA-graph runner's host side on the CPU, decode graphs only (mixed graphs: see
tests/test_mla_mixed_graphs.py): every decode step run through the padded graph body (padding sequences with
seq_len 0, padding rows with slot -1) equals the eager forward; the rest of the steps run eagerly."""
from __future__ import annotations

import pytest
from deepseek_factory import make_deepseek_checkpoint
from test_cuda_graph_host import GREEDY, CheckedGraphs, _llm, _prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_padded_decode_body_equals_eager_forward(tmp_path, smol_tokenizer, name):
    path = make_deepseek_checkpoint(tmp_path / name, name, smol_tokenizer, seed=5)
    kw = {"max_num_batched_tokens": 24, "max_num_seqs": 6, "async_scheduling": True}
    want = _llm(path, **kw).generate(_prompts(7), GREEDY, use_tqdm=False)
    llm = _llm(path, **kw)
    eng = llm.engine
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, 4, eng.device,
                                               max_num_batched_tokens=24, mixed=False)
    got = llm.generate(_prompts(7), GREEDY, use_tqdm=False)
    assert graphs.worst < 1e-4, graphs.worst
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graphs.used and all(k.decode for _, k in graphs.used)
    assert any(k.seqs > t for t, k in graphs.used), "some decode step was padded"
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
