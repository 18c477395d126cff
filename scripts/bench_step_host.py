"""Host time of one engine step's batch building and sampling on the CPU, without the model: 256 decode
sequences (prompt 200 tokens) of random:tiny-llama, runner.prepare and ship_sampling and
sampler.sample + read-back on random [256, 32000] logits, median of 20, per sampling setting.

    OMP_NUM_THREADS=1 python scripts/bench_step_host.py
"""
from __future__ import annotations

import random
import time

import torch

from lamina.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.sampling_params import SamplingParams

CASES = {
    "greedy": {"temperature": 0},
    "temp=0.8 top_k=50 top_p=0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "top_p=0.9 only": {"temperature": 0.8, "top_p": 0.9},
    "min_p=0.05": {"temperature": 0.8, "min_p": 0.05},
    "penalties rep1.1 pres0.5 freq0.5": {"temperature": 0.8, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                                         "frequency_penalty": 0.5},
    "seeded temp=0.8": {"temperature": 0.8, "seed": 1},
    "seeded top_k=50": {"temperature": 0.8, "top_k": 50, "seed": 1},
    "logprobs=5 greedy": {"temperature": 0, "logprobs": 5},
}


def _median_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def bench(label: str, params: SamplingParams, n: int = 256, prompt: int = 200) -> None:
    eng = LLMEngine(EngineConfig("random:tiny-llama", max_num_seqs=n, max_num_batched_tokens=8192,
                                 num_kv_blocks=4000, async_scheduling=False), progress=False)
    eng.stream_outputs = False
    rng = random.Random(0)
    for i in range(n):
        eng.add_request(str(i), [rng.randrange(3, 32000) for _ in range(prompt)], params)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    scheduled = eng.scheduler.schedule().scheduled
    assert len(scheduled) == n and all(s.num_tokens == 1 for s in scheduled)
    logits = torch.randn(n, 32000)
    def prepare():
        batch = eng.runner.prepare(scheduled, None)
        eng.runner.ship_sampling(batch, eng.sampler)
        return batch
    t_prep = _median_ms(prepare)
    batch = prepare()  # its device views stay valid until the next one
    t_samp = _median_ms(lambda: eng.sampler.sample(logits, batch.sampled, batch.sampling, batch.offsets).to_host())
    print(f"{label:36s} prepare {t_prep:7.2f} ms  sample+readback {t_samp:7.2f} ms", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    for label, kw in CASES.items():
        bench(label, SamplingParams(max_tokens=50, ignore_eos=True, **kw))


if __name__ == "__main__":
    main()
