"""Sequence: one sample of a request (a request with n > 1 has n of them), and its group."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from lamina.outputs import PositionLogprobs
from lamina.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DetokState:
    prefix_offset: int
    read_offset: int
    text: str = ""  # all output text decoded so far (before any stop-string cut)


@dataclass(eq=False)  # identity: `seq in running` and remove() compared every field of every sequence
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by output tokens
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None
    max_tokens: int
    detok: DetokState
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # The sliding-window layers' own table when the model also has full layers (cache/kv_groups.py), else [].
    window_table: list[int] = field(default_factory=list)
    # Tokens a proposer guesses follow token_ids, verified by the next step (not part of token_ids until accepted).
    draft_token_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # state-pool slot (hybrid models), leased while admitted
    # Hybrid verify steps: slots leased for the step (candidate j holds the state after the chunk's token j).
    candidate_slots: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain hashes of full blocks
    num_registered_blocks: int = 0  # blocks of block_table already offered to the prefix cache
    # Prefix-cache blocks this running sequence is about to compute (chain hashes from block claim_start on),
    # and, while waiting, the block another sequence is computing for it (see PrefixCache.waits).
    claimed: list[bytes] = field(default_factory=list)
    claim_start: int = 0
    wait_depth: int = 0
    times_passed_over: int = 0  # steps in which mostly-cached requests were admitted ahead of this one
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # output text safe to show (stop strings cut, partial stop-string prefixes held back)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    wants_prompt_logprobs: bool = False
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    grammar: Any = None  # lamina.structured.state.GrammarState of a structured-output request
    first_scheduled_time: float | None = None  # when it first got a step (the end of its queueing)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed once, on the first pass over the prompt (not after a preemption)."""
        return self.wants_prompt_logprobs and self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
