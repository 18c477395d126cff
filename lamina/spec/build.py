"""Builds the engine's SpecDecoder from a checked SpeculativeConfig, refusing (with one line) what this
engine and model cannot do."""
from __future__ import annotations

from typing import TYPE_CHECKING

from lamina.spec.config import SpeculativeConfig
from lamina.spec.decoder import SpecDecoder
from lamina.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from lamina.engine.engine import LLMEngine


def build_spec_decoder(config: SpeculativeConfig | None, engine: LLMEngine) -> SpecDecoder | None:
    if config is None:
        return None
    if config.method == "mtp" and not has_mtp_weights(engine.config.model):  # before any weight is read
        raise ValueError(f"speculative_config: method 'mtp' needs a checkpoint with MTP weights (mtp.*); "
                         f"{engine.config.model} has none")
    if engine.state_pool is not None and config.method == "self_spec":
        raise ValueError("speculative_config: self_spec does not support models with recurrent layers (Gated "
                         "DeltaNet) yet: its drafter would advance their states; use ngram or draft_model")
    if config.method == "ngram":
        return SpecDecoder(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if config.method == "self_spec":
        from lamina.spec.self_spec import SelfSpecProposer

        return SpecDecoder(config, SelfSpecProposer.build(engine, config.skip_layers))
    if config.method == "draft_model":
        from lamina.spec.draft_model import DraftModelProposer

        return SpecDecoder(config, DraftModelProposer.build(engine, config.model))
    if config.method == "mtp":
        from lamina.spec.mtp import MTPProposer

        decoder = SpecDecoder(config, MTPProposer.build(engine))
        engine.runner.keep_hidden = True  # the head reads the target's hidden states (SpecDecoder.observe)
        return decoder
    if config.method == "replay":  # bench only (spec/replay.py): `lamina bench` fills in the reference
        from lamina.spec.replay import ReplayProposer

        # the model's vocabulary, not the lm_head's padded rows: a wrong draft must still embed
        return SpecDecoder(config, ReplayProposer(config.acceptance_prob, engine.model_config.vocab_size,
                                                  config.seed, forced=config.forced))
    raise ValueError(f"speculative_config: method {config.method!r} is not implemented in this build yet")


def load_spec_weights(config: SpeculativeConfig | None, engine: LLMEngine):
    """Weights a proposer keeps on the device, loaded before the KV pool is sized so that its budget sees them
    (and refused, with one line, before anything is allocated): the mtp head (its `kv_layers` become layers of
    the target's KV pool). None for the other methods."""
    if config is None or config.method != "mtp":
        return None
    if not has_mtp_weights(engine.config.model):
        raise ValueError(f"speculative_config: method 'mtp' needs a checkpoint with MTP weights (mtp.*); "
                         f"{engine.config.model} has none")
    from lamina.spec.mtp_head import load_mtp_head

    return load_mtp_head(engine.config.model, engine.model_config, engine.model.model.rope, engine.dtype,
                         engine.device)


def has_mtp_weights(model: str) -> bool:
    """Whether an HF checkpoint directory stores multi-token-prediction tensors (names under mtp.*)."""
    from lamina.spec.mtp_head import mtp_tensor_names

    return bool(mtp_tensor_names(model))
