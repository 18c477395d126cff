"""Structured output: what a request constrains its output to (StructuredOutputsParams), the compiled
grammars (GrammarCompilerService: validation, a cache per spec, compilation off the step loop) and one
sequence's grammar state (GrammarState: advanced with every accepted token, fills its rows of the step's
token bitmask). The sampler applies the bitmask on the device (lamina.structured.bitmask).

Front ends (chat, completions, Messages, Responses) only build a StructuredOutputsParams and put it on
SamplingParams.structured_outputs; everything else happens in the engine.
"""
from lamina.structured.params import StructuredOutputsError, StructuredOutputsParams

__all__ = ["StructuredOutputsError", "StructuredOutputsParams"]
