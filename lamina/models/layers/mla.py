"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Per token the cache keeps only the normed KV latent c (kv_lora_rank) and the rotated rope key k_pe
(qk_rope_head_dim), shared by all heads (LatentAttentionSpec), instead of per-head K and V.

  q      = q_proj(x) | q_b_proj(norm(q_a_proj(x)))          -> per head [q_nope (dn) | q_pe (dr)]
  c, kpe = kv_a_proj_with_mqa(x) -> norm(c), rope(kpe)       -> stored in the cache
  K_h    = [c W_UK_h^T | kpe],  V_h = c W_UV_h^T              (kv_b_proj = [W_UK_h ; W_UV_h] per head)

Two equal ways to attend, chosen per sequence of the step:
  - prefill chunks (query length > 1), expanded: the whole context's latents (earlier chunks and prefix-cache
    hits live only in the cache) are read back and lifted through kv_b_proj to per-head K_nope / V, then
    ordinary causal attention. Cost ~ context x kv_lora_rank x heads x (dn + dv) once per chunk.
  - decode rows, absorbed: q_lat_h = q_nope_h W_UK_h moves the query into latent space, so scores are
    q_lat . c + q_pe . kpe against the cache as it is (MQA-like, kernels/mla_decode.py), and the latent-space
    output is lifted by W_UV_h. No per-token expansion: a decode step reads the cache once.
Softmax scale: (dn + dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as HF computes it).
The rope dims of V3 (rope_interleave, default) and V2 come in (even, odd) pairs; they are reordered to the
two-halves layout before the shared NeoX rope, for q and k alike, so their dot products are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.cache.specs import LatentAttentionSpec, LatentBlocks
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StepContext
from lamina.kernels.mla_decode import gather_latent, mla_decode, store_latent
from lamina.kernels.rope import apply_rope
from lamina.models.config import ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable, yarn_softmax_mscale
from lamina.models.weight_formats import DenseFormat

_LORA_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps


class LatentAttention(nn.Module):
    # Mixed prefill+decode CUDA graphs cannot replay the expanded prefill (it plans from host query lengths):
    # inside one, every row runs the absorbed form instead (_mixed_absorbed: addressed from device metadata
    # only). That reads each prefill row's whole context from the cache (rows x context work, where the
    # expanded form lifts the context once), so graphs take mixed steps up to this many tokens only; larger
    # ones are device-bound and run eagerly, expanded (engine/build.py caps the ladder with it).
    mixed_graphs = True
    mixed_graph_max_tokens = 256
    # Elements of expanded K/V (and of scores) one prefill chunk may materialize at once (~1 GiB in bf16);
    # longer contexts take the key-tiled path (_prefill_tiled).
    expand_budget = 1 << 29

    def __init__(self, cfg: ModelConfig, rope: RopeTable) -> None:
        super().__init__()
        m = cfg.mla
        if m is None:
            raise ValueError("an mla layer needs ModelConfig.mla")
        self.num_heads, self.kv_lora_rank = cfg.num_heads, m.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        h, qk = self.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_lora = m.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim,
                                         bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = Linear(h * m.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = qk ** -0.5 * yarn_softmax_mscale(cfg.rope_scaling)
        self.rope = rope
        # Interleaved rope dims -> two halves: evens then odds (a host list: the module is built on meta).
        dr = m.qk_rope_head_dim
        self.rope_perm = [*range(0, dr, 2), *range(1, dr, 2)] if m.rope_interleave else None
        self._perm: torch.Tensor | None = None  # its device copy, made on first use (before graph capture)
        self._cache: LatentBlocks | None = None
        # W_UK [H, dn, C] and W_UV^T [H, C, dv], dense, derived from kv_b_proj on first use (its format may
        # store it quantized; applying it to the identity gives the dense matrix whatever the format).
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- state -------------------------------------------------------------------------------------------
    def state_spec(self, dtype: torch.dtype) -> LatentAttentionSpec:
        return LatentAttentionSpec(self.kv_lora_rank, self.rope_dim, dtype)

    def bind_state(self, view: LatentBlocks) -> None:
        """Also derives the absorbed weights and the rope permutation on the cache's device: the engine binds
        after loading and before any forward, so a CUDA-graph capture never has to build them."""
        self._cache = view
        # the compute dtype (a norm weight's: the cache may be FP8, the projections quantized)
        like = torch.empty(0, dtype=self.kv_a_layernorm.weight.dtype, device=view.kv.device)
        self._absorbed_weights(like)
        self._rope_index(like.device)

    @property
    def cache(self) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("no latent cache bound (the engine binds one before the first forward)")
        return self._cache.kv

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.reshape(t, 1, self.rope_dim)
        if self.rope_perm is not None:  # not folded into the projections (fold_rope_permutation)
            perm = self._rope_index(x.device)
            q_pe, k_pe = q_pe.index_select(-1, perm), k_pe.index_select(-1, perm)
        # in place on the projections' outputs where they are views (the Triton rope takes row strides)
        q_pe, k_pe = apply_rope(q_pe, k_pe, positions, self.rope.table)
        meta = ctx.attn
        store_latent(latent, k_pe.view(t, self.rope_dim), self.cache, meta.slot_mapping)
        if meta.is_decode_only:
            out = self._decode(q_nope, q_pe, meta.block_tables, meta.seq_lens, meta.seq_lens_cpu, meta.max_seq_len)
        elif getattr(meta, "launch", None) is not None:  # a mixed CUDA graph's metadata (graph_inputs.py)
            out = self._mixed_absorbed(q_nope, q_pe, positions, meta)
        else:
            out = self._mixed(q_nope, q_pe, meta)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _mixed_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """Every row in the absorbed form, from device metadata only (what a mixed graph may read): row r is a
        one-query sequence over its sequence's blocks with context positions[r] + 1 (a causal chunk row sees
        the keys up to its own); rows of a padding sequence (seq_len 0) get context 0, hence zeros."""
        rows = torch.arange(q_nope.shape[0], dtype=meta.query_start.dtype, device=q_nope.device)
        seq = torch.searchsorted(meta.query_start[1:], rows, right=True).clamp_max(meta.seq_lens.shape[0] - 1)
        live = meta.seq_lens.index_select(0, seq) > 0
        lens = torch.where(live, positions + 1, 0).to(torch.int32)
        return self._decode(q_nope, q_pe, meta.block_tables.index_select(0, seq), lens, None, meta.max_seq_len)

    def _mixed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step with prefill chunks: those expanded one sequence at a time, decode rows absorbed together."""
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        qs, lens = meta.query_start_cpu, meta.seq_lens_cpu
        decode = [i for i in range(meta.num_seqs) if qs[i + 1] - qs[i] == 1 and lens[i] > 0]
        if decode:
            rows = torch.tensor([qs[i] for i in decode], device=q_nope.device)
            seqs = torch.tensor(decode, device=q_nope.device)
            res = self._decode(q_nope.index_select(0, rows), q_pe.index_select(0, rows),
                               meta.block_tables.index_select(0, seqs), meta.seq_lens.index_select(0, seqs),
                               [lens[i] for i in decode], max(lens[i] for i in decode))
            out.index_copy_(0, rows, res)
        for i in range(meta.num_seqs):
            if qs[i + 1] - qs[i] > 1 and lens[i] > 0:
                r0, r1 = qs[i], qs[i + 1]
                out[r0:r1] = self._prefill(q_nope[r0:r1], q_pe[r0:r1], meta.block_tables[i], lens[i])
        return out

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int) -> torch.Tensor:
        """One sequence's chunk of L queries (the last L of its seq_len positions), expanded form -> [L, H, dv]."""
        h, dn, c = self.num_heads, self.nope_dim, self.kv_lora_rank
        rows = gather_latent(self.cache, block_table, seq_len).to(q_nope.dtype)  # [S, C + R]
        q = torch.cat([q_nope, q_pe], dim=-1)
        if seq_len * h * self._expanded_width > self.expand_budget:
            return self._prefill_tiled(q, rows)
        kv = self.kv_b_proj(rows[:, :c]).view(seq_len, h, dn + self.v_dim)
        k = torch.cat([kv[..., :dn], rows[:, None, c:].expand(seq_len, h, self.rope_dim)], dim=-1)
        qlen = q.shape[0]
        # [H, L, D] x [H, S, D]; a chunk after earlier context sees all of it plus its own causal part.
        args = (q.transpose(0, 1), k.transpose(0, 1), kv[..., dn:].transpose(0, 1))
        if qlen == seq_len:
            res = F.scaled_dot_product_attention(*args, is_causal=True, scale=self.scale)
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
            mask = key_pos[None, :] <= q_pos[:, None]
            res = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=self.scale)
        return res.transpose(0, 1)

    @property
    def _expanded_width(self) -> int:
        """Elements per context token and head that the expanded form materializes (kv_b out + K)."""
        return 2 * self.nope_dim + self.v_dim + self.rope_dim

    def _prefill_tiled(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The expanded form over key tiles with an online softmax (fp32), for long contexts: at most
        ~expand_budget elements of expanded K/V and of scores exist at once, instead of the whole context's."""
        h, dn, c, dv = self.num_heads, self.nope_dim, self.kv_lora_rank, self.v_dim
        seq_len, qlen = rows.shape[0], q.shape[0]
        tile = max(16, min(self.expand_budget // (h * self._expanded_width), self.expand_budget // (h * qlen)))
        q_step = qlen if tile * h * qlen <= self.expand_budget else max(16, self.expand_budget // (h * tile))
        out = q.new_empty(qlen, h, dv)
        for q0 in range(0, qlen, q_step):
            q1 = min(qlen, q0 + q_step)
            qh = q[q0:q1].transpose(0, 1).float()  # [H, Lq, D]
            q_pos = torch.arange(seq_len - qlen + q0, seq_len - qlen + q1, device=q.device)
            m = torch.full((h, q1 - q0), float("-inf"), device=q.device)
            denom = torch.zeros(h, q1 - q0, device=q.device)
            acc = torch.zeros(h, q1 - q0, dv, device=q.device)
            for s0 in range(0, seq_len - qlen + q1, tile):  # keys past the last query are never seen
                s1 = min(seq_len - qlen + q1, s0 + tile)
                kv = self.kv_b_proj(rows[s0:s1, :c]).view(s1 - s0, h, dn + dv).float()
                s = (torch.einsum("hld,nhd->hln", qh[..., :dn], kv[..., :dn])
                     + torch.einsum("hlr,nr->hln", qh[..., dn:], rows[s0:s1, c:].float())) * self.scale
                if s1 > q_pos[0]:  # the tile reaches into the chunk: causal mask
                    s = s.masked_fill(torch.arange(s0, s1, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))  # finite from the first tile on (key 0 is visible)
                alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
                denom = denom * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + torch.einsum("hln,nhd->hld", p, kv[..., dn:])
                m = m_new
            out[q0:q1] = (acc / denom[..., None]).transpose(0, 1).to(q.dtype)
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                seq_lens_cpu: list[int], max_seq_len: int) -> torch.Tensor:
        """Rows of one token each (row b = sequence b of the tables), absorbed form -> [B, H, dv]."""
        w_uk, w_uv_t = self._absorbed_weights(q_nope)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        # both kernels read rows by stride (unit stride in the last dim only): no copies of q_lat / q_pe
        out_lat = mla_decode(q_lat, q_pe, self.cache, block_tables, seq_lens, self.scale, seq_lens_cpu, max_seq_len)
        return torch.bmm(out_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [B, H, dv]

    @torch.no_grad()
    def fold_rope_permutation(self) -> bool:
        """Once weights are loaded: reorders the rope rows of the q and kv_a projections (interleaved pairs ->
        two halves), so each step's q_pe and k_pe come out in rope order and the two index_select launches per
        layer and step go. Only q_pe / k_pe read those rows (rope, then dot products of q and k permuted alike),
        so outputs are unchanged. Dense, unsplit projections only (else the per-step permutation stays)."""
        if self.rope_perm is None:
            return True
        q = self.q_b_proj if self.q_lora else self.q_proj
        kv = self.kv_a_proj_with_mqa
        if any(type(getattr(m, "format", None)) is not DenseFormat or m.format.partition is not None
               for m in (q, kv)):
            return False
        perm = torch.tensor(self.rope_perm, device=q.weight.device)
        heads = q.weight.view(self.num_heads, self.nope_dim + self.rope_dim, -1)
        heads[:, self.nope_dim:] = heads[:, self.nope_dim:].index_select(1, perm)
        for p in (kv.weight, kv.bias):
            if p is not None:
                p[self.kv_lora_rank:] = p[self.kv_lora_rank:].index_select(0, perm)
        if q.bias is not None:
            qb = q.bias.view(self.num_heads, -1)
            qb[:, self.nope_dim:] = qb[:, self.nope_dim:].index_select(1, perm)
        self.rope_perm = None
        self._perm = None
        return True

    def _rope_index(self, device: torch.device) -> torch.Tensor | None:
        if self.rope_perm is not None and (self._perm is None or self._perm.device != device):
            self._perm = torch.tensor(self.rope_perm, device=device)
        return self._perm

    @torch.no_grad()
    def _absorbed_weights(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK, W_UV^T) in like's dtype and device, derived once (weights are fixed after loading)."""
        have = self._absorbed
        if have is None or have[0].device != like.device or have[0].dtype != like.dtype:
            eye = torch.eye(self.kv_lora_rank, dtype=like.dtype, device=like.device)
            w = self.kv_b_proj(eye).t().reshape(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            self._absorbed = (w[:, :self.nope_dim].contiguous(), w[:, self.nope_dim:].transpose(1, 2).contiguous())
        return self._absorbed
