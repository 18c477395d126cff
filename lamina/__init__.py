"""lamina: an LLM inference engine."""
from lamina.outputs import CompletionOutput, Logprob, RequestOutput
from lamina.sampling_params import SamplingParams
from lamina.structured.params import StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `lamina --help` stays fast.
    if name == "LLM":
        from lamina.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
