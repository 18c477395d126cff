"""self_spec's drafter through its decode graphs: the padded graph body of the kept layers (what a CUDA replay
computes, run eagerly on the CPU with exact host fields) drafts exactly what the eager drafter drafts, at
every batch size a generation passes through, and greedy outputs stay those of plain decoding. The captured
graphs themselves run in scripts/gpu_smol_spec.sh (the built-in SmolLM2 on the H200)."""
from __future__ import annotations

import pytest
from spec_helpers import GREEDY64, all_free, make, outputs, spec_prompts

from lamina.engine.cuda_graph import CudaGraphRunner
from lamina.spec.self_spec import KeptLayers

SELF_SPEC = {"method": "self_spec", "num_speculative_tokens": 3, "skip_layers": [1], "min_acceptance_rate": 0.0}


class GraphBody:
    """Stands in for the CUDA graphs: the same padding, keys and body, replayed eagerly."""

    def __init__(self, runner: CudaGraphRunner) -> None:
        self.runner, self.calls, self.keys = runner, 0, set()

    def can_run(self, batch) -> bool:
        return self.runner.can_run(batch)

    def run(self, batch):
        self.calls += 1
        key = self.runner.pick(batch)
        self.keys.add(key)
        return self.runner.run_eager(batch, key)


def drafts_of(llm, prompts) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Greedy outputs and every proposal the drafter made, in order."""
    proposer, seen = llm.engine.spec.proposer, []
    propose = proposer.propose

    def recording(seqs, k):
        out = propose(seqs, k)
        seen.append([list(d) for d in out])
        return out

    proposer.propose = recording
    return outputs(llm, prompts, GREEDY64), seen


@pytest.fixture(scope="module")
def prompts_and_ref(checkpoints, one_thread):
    ps = spec_prompts(6)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


def test_graph_body_drafts_what_the_eager_drafter_drafts(checkpoints, prompts_and_ref):
    ps, ref = prompts_and_ref
    eager = make(checkpoints["llama"], speculative_config=SELF_SPEC)
    assert eager.engine.spec.proposer.graphs is None  # CPU: no graphs unless installed
    out_eager, drafts_eager = drafts_of(eager, ps)

    graphed = make(checkpoints["llama"], speculative_config=SELF_SPEC)
    eng, proposer = graphed.engine, graphed.engine.spec.proposer
    runner = CudaGraphRunner(KeptLayers(eng.model, proposer.keep), eng.config.max_num_seqs, eng.max_model_len,
                             eng.config.block_size, eng.device, mixed=False)
    assert all(k.decode for k in runner.keys)  # one token per sequence: decode graphs only
    proposer.graphs = GraphBody(runner)
    out_graph, drafts_graph = drafts_of(graphed, ps)

    assert out_eager == out_graph == ref
    assert drafts_graph == drafts_eager and sum(len(d) for p in drafts_graph for d in p) > 0
    # every pass went through the body, padded to more than one batch size
    assert proposer.graphs.calls > 0 and len(proposer.graphs.keys) > 1
    assert any(k.seqs > 1 for k in proposer.graphs.keys)
    assert all_free(graphed)


def test_kept_layers_run_the_models_own_loop(checkpoints, one_thread):
    """Keeping every layer is the target's forward (embedding scale, final norm and lm_head included)."""
    import torch

    llm = make(checkpoints["qwen3"], speculative_config={"method": "self_spec", "num_speculative_tokens": 2})
    eng = llm.engine
    model = eng.model
    kept = KeptLayers(model, list(range(len(model.model.layers))))
    seq = [{"prompt_token_ids": [5, 17, 99, 1000, 7]}]
    eng.add_request("0", seq[0], GREEDY64)
    batch = eng.runner.prepare([s for s in eng.scheduler.schedule().scheduled])
    with torch.inference_mode():
        full = model.forward(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)
        sub = kept.compute_logits(kept.hidden_states(batch.input_ids, batch.positions, batch.ctx)
                                  .index_select(0, batch.logits_indices))
    torch.testing.assert_close(sub, full, rtol=0, atol=0)
