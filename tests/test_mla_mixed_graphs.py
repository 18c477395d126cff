"""MLA models' mixed prefill+decode steps through the CUDA-graph body on the CPU: inside a mixed graph every row
runs the absorbed form from device metadata only (layers/mla.py _mixed_absorbed), and the padded body's logits
equal the eager forward's (expanded prefill chunks, absorbed decode rows) at every step of real generations,
with decode and mixed graphs both used; mixed steps over the MLA cap (mixed_graph_max_tokens) run eagerly."""
from __future__ import annotations

import pytest
from deepseek_factory import make_deepseek_checkpoint
from test_cuda_graph_host import GREEDY, CheckedGraphs, _llm, _prompts

from lamina.engine.build import build_graphs
from lamina.models.layers.mla import LatentAttention

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_padded_mixed_body_equals_eager_forward(tmp_path, smol_tokenizer, name):
    path = make_deepseek_checkpoint(tmp_path / name, name, smol_tokenizer, seed=6)
    kw = {"max_num_batched_tokens": 24, "max_num_seqs": 6, "async_scheduling": True}
    want = _llm(path, **kw).generate(_prompts(7), GREEDY, use_tqdm=False)
    llm = _llm(path, **kw)
    eng = llm.engine
    eng.runner.graphs = graphs = CheckedGraphs(eng.model, 6, eng.max_model_len, 4, eng.device,
                                               max_num_batched_tokens=24)
    got = llm.generate(_prompts(7), GREEDY, use_tqdm=False)
    assert graphs.worst < 1e-4, graphs.worst
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert {k.decode for _, k in graphs.used} == {True, False}
    assert any(k.tokens > t for t, k in graphs.used if not k.decode), "some mixed step was padded"
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups


def test_build_caps_mixed_graphs_at_the_mla_limit(tmp_path, smol_tokenizer, monkeypatch):
    import lamina.engine.cuda_graph as cg

    path = make_deepseek_checkpoint(tmp_path / "v2", "deepseek_v2", smol_tokenizer, seed=7)
    llm = _llm(path, max_num_batched_tokens=2048, max_num_seqs=4)
    seen = {}

    class Probe:  # records what build_graphs asks for; captures nothing
        def __init__(self, model, max_num_seqs, max_model_len, block_size, device, pad, tokens, mixed=None,
                     verify_width=0):
            seen.update(tokens=tokens, mixed=mixed)

        def capture(self):
            pass

    monkeypatch.setattr(cg, "CudaGraphRunner", Probe)
    monkeypatch.setattr("lamina.engine.build.triton_available", lambda: True)
    eng = llm.engine
    build_graphs(eng.config, eng.model, eng.max_model_len, None, type(eng.device)("cuda"))
    assert seen == {"tokens": LatentAttention.mixed_graph_max_tokens, "mixed": None}
