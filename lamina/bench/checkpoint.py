"""`random:` presets as HF configs and checkpoints: what the HF and vLLM baselines load, and what
`lamina bench save-random` writes so `lamina serve` and `vllm serve` can serve one and the same checkpoint."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# HF model_type of each preset architecture (AutoConfig.for_model needs the type, presets name the class).
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "MistralForCausalLM": "mistral", "Qwen3MoeForCausalLM": "qwen3_moe",
               "Qwen3NextForCausalLM": "qwen3_next", "NemotronHForCausalLM": "nemotron_h",
               "Gemma3ForCausalLM": "gemma3_text", "DeepseekV2ForCausalLM": "deepseek_v2",
               "DeepseekV3ForCausalLM": "deepseek_v3"}
# Files of an HF tokenizer directory that a served checkpoint needs (the ones present are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def random_hf_config(preset: str, dtype: str = "bfloat16"):
    """The transformers config of a `random:` preset (architectures and dtype set, so it saves complete)."""
    import transformers

    from lamina.models.presets import preset_config

    cfg = preset_config(preset)
    arch = cfg["architectures"][0]
    return transformers.AutoConfig.for_model(MODEL_TYPES[arch], dtype=dtype, **cfg)


def save_config(preset: str, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Writes only config.json: enough for a loader that makes up its weights (vLLM's load_format="dummy")."""
    out = Path(out_dir)
    random_hf_config(preset, dtype).save_pretrained(out)
    return out


def save_random_checkpoint(preset: str, out_dir: str | Path, dtype: str = "bfloat16",
                           tokenizer_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Builds the preset with HF's random init and saves it as safetensors (plus the tokenizer files of
    tokenizer_dir, which servers need to turn output ids into text)."""
    import torch
    import transformers

    out = Path(out_dir)
    copied = [] if tokenizer_dir is None else [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
    if tokenizer_dir is not None and not copied:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_dir}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(random_hf_config(preset, dtype),
                                                          dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    for f in copied:
        shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out


def add_save_random_parser(bsub) -> None:
    p = bsub.add_parser("save-random", help="save a random: preset as an HF checkpoint (for lamina/vllm serve)")
    p.add_argument("preset", help="preset name, e.g. qwen3-0.6b (see lamina/models/presets.py)")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory whose files are copied in")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_save_random)


def cmd_save_random(args: argparse.Namespace) -> int:
    out = save_random_checkpoint(args.preset.removeprefix("random:"), args.out_dir, args.dtype, args.tokenizer,
                                 args.seed)
    print(f"saved random:{args.preset.removeprefix('random:')} to {out}")
    return 0
