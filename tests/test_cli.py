"""The command line and checkpoint layouts: sharded safetensors, `lamina generate`, `lamina chat`."""
from __future__ import annotations

import io

import torch
from model_factory import hf_logprobs, make_checkpoint

from lamina import LLM, SamplingParams
from lamina.cli import main


def test_sharded_checkpoint_loads(tmp_path, smol_tokenizer):
    import transformers

    path = make_checkpoint(tmp_path / "one", "qwen3", smol_tokenizer, seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="2MB")
    smol_tokenizer.save_pretrained(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = list(range(500, 530))
    llm = LLM(model=str(tmp_path / "sharded"), dtype="float32", device="cpu", num_kv_blocks=16, progress=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ref = hf_logprobs(path, ids)
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    assert (ours - ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max() <= 1e-4


def test_generate_command(checkpoints, capsys):
    rc = main(["generate", "--model", str(checkpoints["llama"]), "--max-tokens", "5", "--kv-cache-memory-gb", "0.01",
               "Hello", "World"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("### prompt:") == 2 and "[length, 5 tokens]" in out


def test_chat_streams_the_reply(checkpoints):
    from lamina.chat_cli import stream_reply

    llm = LLM(model=str(checkpoints["llama"]), dtype="float32", device="cpu", num_kv_blocks=64, progress=False)
    buf = io.StringIO()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = stream_reply(llm, "c0", [5, 6, 7, 8], params, out=buf)
    assert buf.getvalue() == text + "\n"
    assert text == llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0].text
