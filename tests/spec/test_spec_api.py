"""The speculative-decoding surface: LLM(speculative_config=...) and `--speculative-config` take the same
JSON, bad configs are refused at start-up with one line (unknown method, K < 1, mtp without MTP weights,
self_spec on hybrid models), and the counters reach /metrics through EngineStats (msgpack round trip included)."""
from __future__ import annotations

import msgspec
import pytest
from hybrid_helpers import make_hybrid_checkpoint
from spec_helpers import make

from lamina.args import CliParser, add_engine_args, engine_kwargs
from lamina.engine.engine import EngineStats
from lamina.engine.ipc import Codec, IterationStats, StepOutputs
from lamina.spec.config import SpeculativeConfig


def test_cli_and_llm_take_the_same_json(checkpoints):
    p = CliParser(prog="lamina serve")
    add_engine_args(p)
    args = p.parse_args(["--model", str(checkpoints["llama"]), "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}'])
    kw = engine_kwargs(args)
    assert kw["speculative_config"] == SpeculativeConfig("ngram", 2, prompt_lookup_max=5)
    llm = make(checkpoints["llama"], speculative_config=kw["speculative_config"].to_dict())
    assert llm.engine.spec is not None and llm.engine.spec.k == 2


def test_cli_refuses_bad_json_with_one_line(capsys):
    p = CliParser(prog="lamina serve")
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    err = capsys.readouterr().err.splitlines()
    assert "num_speculative_tokens must be an integer >= 1" in err[0]


@pytest.mark.parametrize("cfg, words", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": -1}, ">= 1"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "needs a checkpoint with MTP weights"),
])
def test_llm_refuses_at_start_up(checkpoints, cfg, words):
    with pytest.raises(ValueError) as e:
        make(checkpoints["llama"], speculative_config=cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_self_spec_on_hybrid_models_refused(tmp_path_factory, smol_tokenizer):
    path = make_hybrid_checkpoint(tmp_path_factory.getbasetemp() / "hybrid_ckpt" / "qwen3_next", "qwen3_next",
                                  smol_tokenizer, seed=10)
    with pytest.raises(ValueError, match="recurrent layers"):
        make(path, speculative_config={"method": "self_spec", "num_speculative_tokens": 2})


def test_metrics_from_engine_stats():
    pytest.importorskip("prometheus_client")
    from lamina.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    codec = Codec()
    for drafts, tokens, acc, per_pos in ((2, 6, 3, [2, 1, 0]), (5, 15, 9, [5, 3, 1])):
        stats = EngineStats(1, 0, 10, 10, num_spec_drafts=drafts, num_spec_draft_tokens=tokens,
                            num_spec_accepted_tokens=acc, spec_accepted_per_position=per_pos)
        msg = codec.from_core.decode(codec.encode(StepOutputs(1, [], IterationStats(), stats)))
        assert msg.stats == stats
        m.on_iteration(IterationStats(), msg.stats)
    sample = {s.name + str(sorted(s.labels.items())): s.value
              for fam in m.registry.collect() for s in fam.samples}
    assert sample["lamina:spec_decode_num_drafts_total[('model_name', 'x')]"] == 5
    assert sample["lamina:spec_decode_num_draft_tokens_total[('model_name', 'x')]"] == 15
    assert sample["lamina:spec_decode_num_accepted_tokens_total[('model_name', 'x')]"] == 9
    pos = {j: sample[f"lamina:spec_decode_num_accepted_tokens_per_pos_total[('model_name', 'x'), ('position', '{j}')]"]
           for j in range(3)}
    assert pos == {0: 5, 1: 3, 2: 1}
    assert isinstance(msgspec.msgpack.encode(stats), bytes)
