"""What the hybrid graph-body tests share: a CudaGraphRunner that runs each step's graph body through the Triton
kernels (Triton's interpreter on a CPU) on the padded graph metadata, whose host fields describe only the key
(exact_host=False, as in a capture), and compares it with the eager forward of the same step through the torch
references on the unpadded step.

Besides logits and every real sequence's conv / recurrent state, it records what a captured graph bakes in on
the host: every Triton launch (kernel, grid, scalar arguments, tensor shapes / strides / dtypes, compile
options) and every torch op (name, argument shapes, scalar arguments) of the body. A graph is captured with one
batch composition and replayed with others, so two steps that replay one key must launch exactly the same
sequence (`signature_conflicts`), and the body must read nothing back to the host (`host_reads`).
"""
from __future__ import annotations

import importlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lamina.engine.cuda_graph import CudaGraphRunner

# Modules that bind dispatch.use_triton at import: switched to the Triton kernels for the graph body only.
DISPATCHING = ["gemv", "norm_gated", "attention_prep", "norm", "conv1d", "gated_delta", "moe", "rope", "activation",
               "attention"]
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), tuple(x.stride()), x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_describe(v) for v in x)
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return x
    return type(x).__name__


class _Recorder(TorchDispatchMode):
    """Torch ops of the body; ops a Triton launch runs inside the interpreter (its argument copies) are not the
    body's and are skipped."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log, self.in_kernel = log, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_kernel:
            self.log.append(("op", str(func), _describe(args), _describe(kwargs)))
        return func(*args, **kwargs)


class TritonBodyCheck(CudaGraphRunner):
    """Runs each step's graph body through the Triton kernels and compares it with the eager reference forward
    of the same step; returns the reference logits. At most max_checks steps of each kind (decode / mixed) are
    checked (the interpreter is slow); the others run the reference only."""

    def __init__(self, *a, state_pool, monkeypatch, max_checks=3, state_tol=1e-3, **kw):
        super().__init__(*a, **kw)
        self.state_pool, self.mp, self.max_checks, self.state_tol = state_pool, monkeypatch, max_checks, state_tol
        self.checked: list[tuple[int, bool, int]] = []  # (real rows, decode graph, padded rows)
        self.worst = 0.0
        self.errors: list[str] = []  # the engine turns a failing step into failed requests: keep the reason
        self.signatures: dict = {}  # key -> list of (composition, launch log)
        self.host_reads: list[str] = []

    def run(self, batch):
        try:
            return self._run(batch)
        except AssertionError as e:
            self.errors.append(repr(e))
            raise

    def want_check(self, batch, key) -> bool:
        return sum(1 for _, d, _ in self.checked if d == key.decode) < self.max_checks

    def _body_logged(self, batch, key):
        import triton.runtime.interpreter as interp

        log: list = []
        rec = _Recorder(log)
        orig = interp.InterpretedFunction.run

        def run(fn_self, *args, grid, warmup, **kwargs):
            log.append(("launch", fn_self.fn.__name__, _describe(grid), _describe(args),
                        tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))))
            rec.in_kernel = True
            try:
                return orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                rec.in_kernel = False

        with self.mp.context() as m:
            for name in DISPATCHING:
                m.setattr(importlib.import_module(f"lamina.kernels.{name}"), "use_triton", lambda t: True)
            m.setattr(interp.InterpretedFunction, "run", run)
            with torch.inference_mode():
                self.inputs.load(batch, key)  # the replay's input copies (not part of the graph)
                with rec:
                    hidden = self.body(key, exact_host=False)
                got = self.logits(batch, hidden)
        self.host_reads += [e[1] for e in log if e[0] == "op" and e[1] in HOST_READS]
        return got, log

    def _run(self, batch):
        key = self.pick(batch)
        pool = [t for pair in self.state_pool.tensors for t in pair]
        before = [t.clone() for t in pool]
        with torch.inference_mode():
            ref = self.model(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)
        if not self.want_check(batch, key):
            return ref
        after = [t.clone() for t in pool]
        for t, b in zip(pool, before):
            t.copy_(b)
        got, log = self._body_logged(batch, key)
        pad = self.padding_slot
        for t, a in zip(pool, after):
            err = (t[:pad].float() - a[:pad].float()).abs().max().item()
            assert err < self.state_tol, ("state", err, key)
        if ref.numel():
            self.worst = max(self.worst, (got - ref).abs().max().item())
        self.checked.append((batch.input_ids.shape[0], key.decode, key.tokens))
        qs = batch.ctx.attn.query_start_cpu
        self.signatures.setdefault(key, []).append((tuple(qs[i + 1] - qs[i] for i in range(len(qs) - 1)), log))
        for t, a in zip(pool, after):  # continue from the reference's states
            t.copy_(a)
        return ref

    def signature_conflicts(self) -> list[str]:
        """Keys replayed with several compositions whose launches differ: what a capture would have baked in."""
        out = []
        for key, runs in self.signatures.items():
            first_comp, first = runs[0]
            for comp, log in runs[1:]:
                if log != first:
                    i = next((j for j, (a, b) in enumerate(zip(first, log)) if a != b), min(len(first), len(log)))
                    out.append(f"{key}: {first_comp} vs {comp} differ at entry {i}: "
                               f"{first[i] if i < len(first) else None} / {log[i] if i < len(log) else None}")
        return out

    def compositions(self, key) -> int:
        return len({c for c, _ in self.signatures.get(key, [])})
