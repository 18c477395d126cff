"""The near-tie-aware comparison of scripts/hybrid_graph_check.py (graphs vs eager on the 80B shape): the GPU check
is only as good as this verdict, so it is tested on hand-made outputs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("hybrid_graph_check", ROOT / "scripts" / "hybrid_graph_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compare


def _req(tokens, logprobs, prompt=None):
    return {"tokens": tokens, "logprobs": [{str(t): v for t, v in d.items()} for d in logprobs],
            "prompt_logprobs": prompt or []}


def test_equal_runs_agree_fully(compare):
    want = [_req([5, 6], [{5: -0.1, 7: -2.0}, {6: -0.3, 8: -1.0}])]
    got = [_req([5, 6], [{5: -0.1005, 7: -2.0}, {6: -0.3, 8: -1.0}])]
    c = compare(got, want, 1e-2)
    assert c["full_agreement"] == 1 and not c["mismatches"] and c["max_dlogprob"] == pytest.approx(5e-4)


def test_divergence_verdicts(compare):
    eager = {5: -1.000, 7: -1.004, 9: -3.0}  # eager's best is 5; 7 is within 1e-2 of it, 9 is not
    want = [_req([5, 1], [eager, {1: -0.1}])] * 4
    got = [_req([7, 2], [{7: -1.0, 5: -1.004}, {2: -0.1}]),  # a near-tie: allowed, the rest is not compared
           _req([9], [{9: -1.0}]),  # eager gives it 2.0 less than its best: a mismatch
           _req([4], [{4: -1.0}]),  # not in eager's top-N, whose last entry is 2.0 below the best: a mismatch
           _req([5, 1], [eager, {1: -0.1}])]
    c = compare(got, want, 1e-2)
    assert c["near_ties"] == 1 and c["full_agreement"] == 1 and c["unresolved_ties"] == 0
    assert [m[:2] for m in c["mismatches"]] == [(1, 0), (2, 0)]


def test_unresolved_when_eagers_top_n_is_all_tied(compare):
    want = [_req([5], [{5: -1.0, 7: -1.001}])]  # every listed token within the tie: the graph's may be too
    c = compare([_req([4], [{4: -1.0}])], want, 1e-2)
    assert c["unresolved_ties"] == 1 and not c["mismatches"]


def test_prompt_logprobs_count_in_the_worst_difference(compare):
    want = [_req([5], [{5: -0.1}], prompt=[None, {"3": -2.0, "4": -1.0}])]
    got = [_req([5], [{5: -0.1}], prompt=[None, {"3": -2.5, "4": -1.0}])]
    assert compare(got, want, 1e-2)["max_dlogprob"] == pytest.approx(0.5)
