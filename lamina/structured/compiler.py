"""Grammar compilation through xgrammar: validation (cheap, at request arrival, so a bad constraint is that
request's 400), and compilation against the tokenizer on a worker thread with a bounded cache, so the step
loop never waits on it (a request waits, outside the scheduler, until its grammar is ready).
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lamina.structured.params import StructuredOutputsError, StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: ".
_NOISE = re.compile(r"^\[[\d:]+\] \S+: (Check failed: .*? is false: )?")
# Whitespace the JSON grammar allows between tokens: unbounded runs let a small model loop on spaces.
MAX_JSON_WHITESPACE = 8
CACHE_SIZE = 256  # compiled grammars kept (LRU); a schema of a hot tool set compiles once
ENV_WS_ON_HOST = "LAMINA_JSON_WHITESPACE_ON_HOST"  # 1: the run bound on the host (structured/whitespace.py)


def whitespace_on_host() -> bool:
    """LAMINA_JSON_WHITESPACE_ON_HOST=1: JSON grammars with unbounded whitespace, runs ended by the engine."""
    return os.environ.get(ENV_WS_ON_HOST, "0").strip() not in ("", "0")


def host_bounds_whitespace(spec: StructuredOutputsParams) -> bool:
    """Whether this constraint's whitespace runs are bounded on the host (JSON with any whitespace, opt-in)."""
    return spec.kind in ("json", "json_object") and not spec.disable_any_whitespace and whitespace_on_host()


def _reason(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _choice_ebnf(choice: list[str]) -> str:
    # JSON string escapes are valid EBNF string-literal escapes in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c) for c in choice)


def _schema_text(value: str | dict[str, Any]) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise StructuredOutputsError(f"invalid JSON schema: not JSON ({e})") from None
        return value
    return json.dumps(value)


def build_grammar(spec: StructuredOutputsParams):
    """The xgrammar.Grammar of a constraint (no tokenizer needed); StructuredOutputsError with the reason
    if the schema, regex or grammar is invalid."""
    import xgrammar as xg

    kind = spec.kind
    ws = {"any_whitespace": not spec.disable_any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    if host_bounds_whitespace(spec):  # the bound costs the fill ~4x (structured/whitespace.py)
        del ws["max_whitespace_cnt"]
    try:
        if kind == "json":
            return xg.Grammar.from_json_schema(_schema_text(spec.json), strict_mode=spec.strict, **ws)
        if kind == "json_object":
            return xg.Grammar.from_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return xg.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xg.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        if kind == "grammar":
            return xg.Grammar.from_ebnf(spec.grammar)
        return xg.Grammar.from_structural_tag(spec.structural_tag)
    except StructuredOutputsError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
        label = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                 "grammar": "grammar", "structural_tag": "structural tag"}[kind]
        raise StructuredOutputsError(f"invalid {label}: {_reason(e)}") from None


class GrammarCompilerService:
    """Compiles constraints for one tokenizer. check() validates synchronously (microseconds for typical
    schemas); submit() returns a future of the CompiledGrammar, computed on one worker thread (xgrammar
    itself spreads a compilation over its own threads) and cached by the constraint's key.

    vocab_size: the model's logits width (it may exceed the tokenizer's; the extra ids are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_threads: int = 4) -> None:
        self.vocab_size = vocab_size
        self._tokenizer, self._stop, self._threads = tokenizer, stop_token_ids, max_threads
        self._compiler = None  # built on the worker thread (reading a large vocabulary takes ~1 s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lamina-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.ws_tables = None  # structured/whitespace.py's, made with the compiler when the bound is on the host

    def check(self, spec: StructuredOutputsParams) -> None:
        build_grammar(spec)

    def compiled(self, spec: StructuredOutputsParams) -> bool:
        """True if this constraint compiled already (so it is valid: a check can be skipped)."""
        with self._lock:
            fut = self._cache.get(spec.key())
        return fut is not None and fut.done() and fut.exception() is None

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once on a cache hit). A failed compilation is not kept."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputsParams):
        if self._compiler is None:  # only the one worker thread gets here
            import xgrammar as xg

            info = xg.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                     stop_token_ids=self._stop or None)
            if whitespace_on_host():  # before the compiler: a state attached after its grammar compiled finds it
                from lamina.structured.whitespace import WhitespaceTables

                self.ws_tables = WhitespaceTables(info.decoded_vocab, self.vocab_size)
            self._compiler = xg.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
        return self._compiler.compile_grammar(build_grammar(spec))

    def compile(self, spec: StructuredOutputsParams):
        """Synchronous compile (tests, tools)."""
        return self.submit(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
