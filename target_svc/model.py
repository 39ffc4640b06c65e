"""Our target forward over the HF modules' weights: padded batches of trees (or chains) against the slot cache.

HF submodules do the norms, MLPs and projections (on CUDA: our fused projections and compiled glue instead,
target_svc/dense_layers.py and hybrid_layers.py); attention, RoPE, masking, the cache and the Gated DeltaNet state
handling are ours, so that decode/verify can be captured (static shapes, no Python per node).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_serve.decoding.acceptance import compaction_indices_batch
from ddtree_serve.decoding.tree_mask import TreeStructure, tree_attention_mask, tree_structure
from ddtree_serve.kernels import tree_attention
from ddtree_serve.kernels.tree_attention import TreeKeys
from target_svc import gdn_kernels, tree_layout
from target_svc.gated_deltanet import (
    GdnTreeTrace,
    LinearAttnStateShape,
    gdn_chain_forward,
    gdn_commit_path,
    gdn_step_forward_lean,
    gdn_tree_forward_lean,
)
from target_svc.dense_layers import DenseKernels, DenseLayerWeights, fusable, fuse_weights
from target_svc.gdn_tree_wy import (
    GdnTreeLayout,
    GdnTreeWYTrace,
    accepted_path,
    gdn_commit_path_wy,
    gdn_tree_forward_wy,
    gdn_tree_layout,
)
from target_svc.hybrid_layers import (
    FusedGdn,
    HybridKernels,
    HybridLayerWeights,
    apply_rope,
    fusable_hybrid,
    fuse_hybrid,
)
from target_svc.kv_cache import CacheSpec, KVCache
from target_svc.loader import FULL_ATTENTION, LoadedTarget
from target_svc.quantization import int8_matmul_backend, linear

log = logging.getLogger(__name__)


class TargetModel:
    """The target decoder bound to one KVCache; forward_block verifies padded trees or prefills chains."""

    def __init__(self, target: LoadedTarget, max_batch: int, max_seq_len: int, max_tree_nodes: int,
                 fused: bool | None = None, tree_gdn: str | None = None, gdn_kernels_on: bool | None = None,
                 state_snapshots: int = 0):
        # fused: run dense layers through target_svc/dense_layers.py, hybrid (Qwen3.5) ones through
        #   target_svc/hybrid_layers.py (fused projections; compiled kernels on CUDA, the plain functions elsewhere).
        # tree_gdn: how Gated DeltaNet layers verify trees: "wy" (all nodes in one pass, no host sync:
        #   target_svc/gdn_tree_wy.py) or "depthwise" (the reference, one update per depth).
        # gdn_kernels_on: Gated DeltaNet prefill chains and decode steps (one-node trees) through fla's kernels
        #   (target_svc/gdn_kernels.py); trees of several nodes keep tree_gdn. None = where available (CUDA with
        #   fla-core installed, DDTREE_GDN_KERNELS not off).
        # None = the fast paths on CUDA; the CPU keeps the reference paths.
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        self.full_index = {layer: i for i, layer in enumerate(target.full_attention_layers)}
        self.linear_index = {layer: i for i, layer in enumerate(target.linear_attention_layers)}
        spec = CacheSpec(
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            max_tree_nodes=max_tree_nodes,
            num_full_layers=len(self.full_index),
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            linear_shapes=tuple(
                LinearAttnStateShape.from_module(target.layers[i].linear_attn) for i in self.linear_index
            ),
            device=target.device,
            dtype=target.dtype,
            state_snapshots=state_snapshots if self.linear_index else 0,
        )
        self.cache = KVCache.allocate(spec)
        self.cos, self.sin = self._rope_tables(spec.capacity)
        if fused is None:
            fused = self.device.type == "cuda"
        self.tree_gdn = tree_gdn or ("wy" if self.device.type == "cuda" else "depthwise")
        if self.tree_gdn not in ("wy", "depthwise"):
            raise ValueError(f"tree_gdn must be 'wy' or 'depthwise', got {self.tree_gdn!r}")
        self.gdn_kernels_on = self._choose_gdn_kernels(gdn_kernels_on)
        self.tree_attention_on = self._choose_tree_attention()
        self.tree_layout_on = tree_layout.available(self.device)
        self.int8_backend = int8_matmul_backend(self.device)
        self.dense: list[DenseLayerWeights] | None = None
        self.kernels: DenseKernels | None = None
        self.hybrid: list[HybridLayerWeights] | None = None
        self.hybrid_kernels: HybridKernels | None = None
        if fused and not self.linear_index and self.cos.shape[-1] == target.head_dim and fusable(target.layers):
            self.dense = fuse_weights(target.layers)
            self.kernels = DenseKernels.make(compiled=self.device.type == "cuda")
        elif fused and self.linear_index and fusable_hybrid(target.layers, target.norm):
            self.hybrid_kernels = HybridKernels.make(compiled=self.device.type == "cuda")
            self.hybrid = fuse_hybrid(target.layers, self.hybrid_kernels, self.int8_backend)
        # GDN traces of the verified block not yet committed (one per linear-attention layer), None when no block
        # is pending; dense models' blocks carry an empty list. The K/V of a pending block sit past ctx_len.
        self.pending_traces: list[GdnTreeTrace | GdnTreeWYTrace] | None = None

    def _choose_gdn_kernels(self, requested: bool | None) -> bool:
        """Whether Gated DeltaNet chains and decode steps run through fla's kernels (False for dense models)."""
        if not self.linear_index or requested is False:
            return False
        ok = gdn_kernels.available(self.device)
        if requested and not ok:
            raise RuntimeError(f"Gated DeltaNet kernels requested but unavailable on {self.device} (they need CUDA "
                               f"and fla-core: pip install 'ddtree-serve[gpu]'; {gdn_kernels.ENV_VAR} not off)")
        log.info("Gated DeltaNet prefill/decode: %s", "fla kernels" if ok else "PyTorch reference")
        return ok

    def _choose_tree_attention(self) -> bool:
        """Whether softmax-attention layers attend through the Triton kernel over the slot cache
        (ddtree_serve/kernels/tree_attention.py): where it runs, unless DDTREE_TREE_ATTENTION is off."""
        if not self.full_index or tree_attention.switched_off():
            return False
        ok = tree_attention.available(self.device, self.target.head_dim, self.dtype)
        log.info("attention: %s", "Triton tree attention over the slot cache" if ok else "SDPA over gathered rows")
        return ok

    def _rope_tables(self, n_positions: int) -> tuple[Tensor, Tensor]:
        """cos/sin [n_positions, rotary_dim] in the model dtype, computed by HF's own rotary module."""
        # A lookup by position is exactly what HF computes per call (elementwise in fp32, then cast to the model
        # dtype); it covers llama3/yarn scaling and partial rotary, and Qwen3.5's M-RoPE, which for text-only
        # positions (the three sections equal) is plain RoPE over the rotary dims. Static, so graph-capturable.
        positions = torch.arange(n_positions, dtype=torch.long)[None, :]
        if hasattr(self.target.rotary_emb, "mrope_section"):
            # M-RoPE modules take [3, B, P] (temporal, height, width); text positions are equal in all three.
            positions = positions[None].expand(3, 1, n_positions)
        probe = torch.zeros(1, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = self.target.rotary_emb(probe, positions)
        return cos[0].to(self.device), sin[0].to(self.device)

    # ------------------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_block(
        self,
        input_ids: Tensor,
        parents: Tensor,
        valid: Tensor,
        ctx_lens: Tensor,
        slots: Tensor,
        *,
        key_len: int | None = None,
        feature_layers: tuple[int, ...] = (),
        chain: bool = False,
        logits_at: Tensor | None = None,
        logits_out: Tensor | None = None,
        features_out: Tensor | None = None,
        structure: TreeStructure | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Padded trees [B, Tmax] at ctx_len + depth -> (logits [B, Tmax, V] in the model dtype, features [B, Tmax, F]
        | None)."""
        # valid[b] is a prefix mask (nodes 0..T_b-1); node i's K/V go to cache row ctx_len + i.
        # chain=True: every row is a chain (prefill / continuation) and linear-attention states are committed at
        #   once; otherwise the block stays pending until commit_block() knows the accepted paths.
        # key_len = max(ctx_len + T_b): the caller knows it on the host, so passing it avoids a device sync.
        # features = cat of HF's hidden_states[i + 1] for i in feature_layers (None when empty).
        # logits_at [B]: logits of that one row per sequence only ([B, 1, V]; a prefill needs only its last).
        # logits_out / features_out: tensors of the outputs' shapes to write them into (a captured graph's shared
        #   output buffers); the returned outputs are then these tensors.
        # structure: self.tree_structure(parents, sizes) when the caller has it (a verify step shares it with its
        #   walk).
        t = self.target
        bsz, tmax = input_ids.shape
        sizes = valid.sum(dim=1)
        if key_len is None:
            key_len = int((ctx_lens + sizes).max())
        if structure is None:
            structure = self.tree_structure(parents, sizes)
        positions = ctx_lens[:, None] + structure.depth
        cos, sin = self.cos[positions], self.sin[positions]  # [B, Tmax, rotary_dim]
        rows = ctx_lens[:, None] + torch.arange(tmax, device=self.device)
        mask = self._attention_keys(ctx_lens, parents, sizes, key_len, structure.anc)

        wanted = set(feature_layers)
        feature_set: dict[int, Tensor] = {}
        traces: list[GdnTreeTrace | GdnTreeWYTrace] = []
        layout = self._tree_layout(parents, valid, chain, tmax, structure)
        h = t.embed_tokens(input_ids)
        if self.dense is not None:
            h = self._dense_layers(h, cos, sin, mask, slots, rows, key_len, wanted, feature_set)
        elif self.hybrid is not None:
            h = self._hybrid_layers(h, cos, sin, mask, slots, rows, key_len, (parents, valid, sizes, chain, layout),
                                    traces, wanted, feature_set)
        else:
            for i, layer in enumerate(t.layers):
                x = layer.input_layernorm(h)
                if t.layer_types[i] == FULL_ATTENTION:
                    mixed = self._attention(layer.self_attn, self.full_index[i], x, cos, sin, mask, slots, rows,
                                            key_len)
                else:
                    mixed = self._linear_attention(
                        layer.linear_attn, self.linear_index[i], x, parents, valid, sizes, slots, chain, traces,
                        layout,
                    )
                h = h + mixed
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                if i in wanted:
                    feature_set[i] = h
            h = t.norm(h)
        # HF's hidden_states[-1] is taken after the final norm; features follow HF's tuple exactly.
        feature_set[t.num_layers - 1] = h
        if logits_at is not None:
            h = h.gather(1, logits_at[:, None, None].expand(bsz, 1, h.shape[-1]))
        logits = t.lm_head(h)
        # In the model dtype: argmax picks the same token as on a float32 copy (the conversion is exact and
        # monotone), and sampling converts the rows it draws from (sampling.choose_tokens); a float32 copy of every
        # row cost a [B, T, V] write per step and twice the graphs' shared logits buffer.
        if logits_out is not None:
            logits = logits_out.copy_(logits)
        features = None
        if feature_layers:
            parts = [feature_set[i] for i in feature_layers]
            features = torch.cat(parts, dim=-1) if features_out is None else torch.cat(parts, dim=-1, out=features_out)
        self.pending_traces = None if chain else traces
        return logits, features

    def tree_structure(self, parents: Tensor, sizes: Tensor) -> TreeStructure:
        """The padded trees' ancestor mask and depths (and, for a one-pass hybrid forward, the GDN conv windows):
        one Triton launch where target_svc/tree_layout.py runs, ddtree_serve's tree_structure elsewhere."""
        if self.tree_layout_on and tree_layout.supports(parents.shape[1]):
            wy = self.linear_index and self.tree_gdn == "wy"
            return tree_layout.tree_layout(parents, sizes, self.cache.spec.linear_shapes[0].conv_kernel if wy else 0)
        return tree_structure(parents, sizes)

    def _attention_keys(self, ctx_lens: Tensor, parents: Tensor, sizes: Tensor, key_len: int,
                        anc: Tensor) -> Tensor | TreeKeys:
        """What the attention layers take to know which cache rows each node sees: the kernel's TreeKeys, or SDPA's
        dense mask [B, 1, rep * Tmax, key_len] (anc: the trees' ancestor mask)."""
        t = self.target
        bsz, tmax = parents.shape
        if self.tree_attention_on and tmax <= tree_attention.MAX_BLOCK_NODES:
            counts = tree_attention.merge_counts(bsz, t.num_kv_heads, t.num_heads // t.num_kv_heads * tmax,
                                                 ctx_lens.device)
            return TreeKeys(ctx_lens, anc, counts)
        mask = tree_attention_mask(ctx_lens, parents, sizes, key_len, anc)  # [B, Tmax, key_len]
        # GQA without copying K/V per query head: the rep query heads of one KV head are stacked along the query
        # axis ([B, n_kv, rep * Tmax, D] against [B, n_kv, key_len, D]), so the mask repeats per stacked head.
        rep = t.num_heads // t.num_kv_heads
        return mask[:, None, None].expand(bsz, 1, rep, tmax, key_len).reshape(bsz, 1, rep * tmax, key_len)

    def _dense_layers(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, slots: Tensor, rows: Tensor,
                      key_len: int, wanted: set[int], feature_set: dict[int, Tensor]) -> Tensor:
        """All layers of a dense model through the fused path -> the final-normed hidden states."""
        t, k = self.target, self.kernels
        layers = t.layers
        norm0 = layers[0].input_layernorm
        x = k.rms_norm(h, norm0.weight, norm0.variance_epsilon)
        for i, layer in enumerate(layers):
            attn, w = layer.self_attn, self.dense[i]
            qkv = linear(x, w.qkv, w.qkv_bias, self.int8_backend)
            bsz, tmax, _ = x.shape
            nh, nkv, hd = t.num_heads, t.num_kv_heads, t.head_dim
            q, key, value = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, key = q.view(bsz, tmax, nh, hd), key.view(bsz, tmax, nkv, hd)
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            q, key = k.qk_norm_rope(q, key, None if qn is None else qn.weight, None if kn is None else kn.weight,
                                    1e-6 if qn is None else qn.variance_epsilon, cos, sin)
            out = self._attend(attn, self.full_index[i], q, key, value.view(bsz, tmax, nkv, hd), mask, slots, rows,
                               key_len)
            post = layer.post_attention_layernorm
            h, x = k.add_rms_norm(h, attn.o_proj(out), post.weight, post.variance_epsilon)
            mlp = layer.mlp.down_proj(k.silu_mul(linear(x, w.gate_up, backend=self.int8_backend)))
            # The next layer's input norm, or after the last layer the model's final norm (HF's last hidden state).
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else t.norm
            h, x = k.add_rms_norm(h, mlp, nxt.weight, nxt.variance_epsilon)
            if i in wanted:
                feature_set[i] = h
        return x

    def _hybrid_layers(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, slots: Tensor, rows: Tensor,
                       key_len: int, block: tuple, traces: list, wanted: set[int],
                       feature_set: dict[int, Tensor]) -> Tensor:
        """All layers of a hybrid model through the fused path -> the final-normed hidden states."""
        # block = (parents, valid, sizes, chain, layout): what the Gated DeltaNet layers take of the trees.
        t, k = self.target, self.hybrid_kernels
        layers = t.layers
        norm0 = layers[0].input_layernorm
        x = k.rms_norm(h, norm0.weight, norm0.eps)
        for i, layer in enumerate(layers):
            w = self.hybrid[i]
            if w.gdn is not None:
                parents, valid, sizes, chain, layout = block
                mixed = self._linear_attention(w.gdn, self.linear_index[i], x, parents, valid, sizes, slots, chain,
                                               traces, layout)
            else:
                mixed = self._gated_attention(layer.self_attn, w.qkv, self.full_index[i], x, cos, sin, mask, slots,
                                              rows, key_len)
            post = layer.post_attention_layernorm
            h, x = k.add_rms_norm(h, mixed, post.weight, post.eps)
            mlp = layer.mlp.down_proj(k.silu_mul(linear(x, w.gate_up, backend=self.int8_backend)))
            # The next layer's input norm, or after the last layer the model's final norm (HF's last hidden state).
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else t.norm
            h, x = k.add_rms_norm(h, mlp, nxt.weight, nxt.eps)
            if i in wanted:
                feature_set[i] = h
        return x

    def _gated_attention(self, attn: nn.Module, qkv_weight, cache_layer: int, x: Tensor, cos: Tensor, sin: Tensor,
                         mask: Tensor, slots: Tensor, rows: Tensor, key_len: int) -> Tensor:
        """Qwen3.5's gated attention through the fused q(+gate)/k/v projection and the compiled glue."""
        t, k = self.target, self.hybrid_kernels
        bsz, tmax, _ = x.shape
        nh, nkv, hd = t.num_heads, t.num_kv_heads, t.head_dim
        qg, key, value = linear(x, qkv_weight, None, self.int8_backend).split([2 * nh * hd, nkv * hd, nkv * hd],
                                                                              dim=-1)
        # q_proj's rows interleave per head as [q | gate] (HF's view(..., -1, 2 * head_dim).chunk(2)).
        q, gate = qg.view(bsz, tmax, nh, 2 * hd).chunk(2, dim=-1)
        q, key = k.qk_norm_rope(q, key.view(bsz, tmax, nkv, hd), attn.q_norm.weight, attn.k_norm.weight,
                                attn.q_norm.eps, cos, sin)
        out = self._attend(attn, cache_layer, q, key, value.view(bsz, tmax, nkv, hd), mask, slots, rows, key_len)
        return attn.o_proj(k.sigmoid_gate(out, gate))

    def _attend(self, attn: nn.Module, cache_layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | TreeKeys,
                slots: Tensor, rows: Tensor, key_len: int) -> Tensor:
        """Writes the block's k/v [B, T, n_kv, D] to the cache, attends q [B, T, n_h, D] -> [B, T, n_h * D] (mask:
        _attention_keys' answer)."""
        t = self.target
        bsz, tmax = q.shape[:2]
        nh, nkv, hd = t.num_heads, t.num_kv_heads, t.head_dim
        self.cache.write_kv(cache_layer, slots, rows, k, v)
        if isinstance(mask, TreeKeys):
            out = tree_attention.tree_attention(q, self.cache.k[cache_layer], self.cache.v[cache_layer], slots, mask,
                                                key_len, attn.scaling)
            return out.view(bsz, tmax, nh * hd)
        keys, values = self.cache.read_kv(cache_layer, slots, key_len)
        rep = nh // nkv
        # GQA: query head h reads kv head h // rep, as HF's repeat_kv; heads kv*rep .. kv*rep + rep - 1 are stacked
        # on the query axis of kv head kv (mask prepared alike in forward_block).
        q = q.view(bsz, tmax, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(bsz, nkv, rep * tmax, hd)
        out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                             scale=attn.scaling)
        return out.view(bsz, nkv, rep, tmax, hd).permute(0, 3, 1, 2, 4).reshape(bsz, tmax, nh * hd)

    def _attention(
        self,
        attn: nn.Module,
        cache_layer: int,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        slots: Tensor,
        rows: Tensor,
        key_len: int,
    ) -> Tensor:
        """Softmax attention over the slot's committed rows plus the block's ancestor rows (tree mask)."""
        t = self.target
        bsz, tmax, _ = x.shape
        nh, nkv, hd = t.num_heads, t.num_kv_heads, t.head_dim
        q = attn.q_proj(x)
        # Qwen3.5 gated attention: q_proj also emits a per-head output gate, interleaved per head as [q | gate].
        gated = q.shape[-1] == 2 * nh * hd
        if gated:
            q, gate = q.view(bsz, tmax, nh, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(bsz, tmax, nh * hd)
        else:
            q = q.view(bsz, tmax, nh, hd)
        k = attn.k_proj(x).view(bsz, tmax, nkv, hd)
        v = attn.v_proj(x).view(bsz, tmax, nkv, hd)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self._attend(attn, cache_layer, q, k, v, mask, slots, rows, key_len)
        if gated:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)

    def _tree_layout(self, parents: Tensor, valid: Tensor, chain: bool, tmax: int,
                     structure: TreeStructure) -> GdnTreeLayout | None:
        """The trees' ancestor mask and conv windows, once for all GDN layers of a one-pass (wy) tree forward."""
        if chain or not self.linear_index or self.tree_gdn != "wy" or (self.gdn_kernels_on and tmax == 1):
            return None
        return gdn_tree_layout(parents, valid, self.cache.spec.linear_shapes[0].conv_kernel, structure)

    def _linear_attention(
        self,
        gdn: nn.Module | FusedGdn,
        state_layer: int,
        x: Tensor,
        parents: Tensor,
        valid: Tensor,
        sizes: Tensor,
        slots: Tensor,
        chain: bool,
        traces: list[GdnTreeTrace],
        layout: GdnTreeLayout | None = None,
    ) -> Tensor:
        """Gated DeltaNet: chains commit their final state; trees keep a trace for the accepted-path replay."""
        state = self.cache.linear[state_layer]
        if not chain and self.tree_gdn == "wy" and not (self.gdn_kernels_on and x.shape[1] == 1):
            # The one-pass tree reads the slots' states in place (the commit gathers what it needs).
            out, trace = gdn_tree_forward_wy(gdn, x, parents, valid, state.conv, state.rec, layout=layout,
                                             state_index=slots)
            traces.append(trace)
            return out
        conv0, rec0 = state.conv[slots], state.rec[slots]
        if chain:
            out, conv, rec = gdn_chain_forward(gdn, x, sizes, conv0, rec0, kernels=self.gdn_kernels_on)
            state.conv[slots] = conv
            state.rec[slots] = rec
            return out
        if self.gdn_kernels_on and x.shape[1] == 1:
            # A decode step (one-node trees): fla's recurrent kernel; committed by gdn_commit_path's kernel replay.
            out, trace = gdn_step_forward_lean(gdn, x, valid, conv0, rec0, kernels=True)
        else:
            out, trace = gdn_tree_forward_lean(gdn, x, parents, valid, conv0, rec0)
        traces.append(trace)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # commit
    # ------------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def commit_block(self, path: Tensor, path_len: Tensor, slots: Tensor, ctx_lens: Tensor,
                     traces: list | None = None) -> None:
        """Commits the pending block's accepted nodes path[b, :path_len[b]] (root first, -1 padded)."""
        # K/V rows ctx + path[b, j] move to ctx + j; linear-attention states become those after the last accepted
        # node, replayed from the committed state along the path (one step per column: pass path narrowed to
        # the deepest possible path). The caller advances ctx_len. slots/ctx_lens are the verified block's;
        # traces are the block's GDN traces (default: those of the last forward_block, which are then consumed).
        if traces is None:
            traces = self.pending_traces
            if traces is None and self.linear_index:
                raise RuntimeError("no pending tree block to commit")
            self.pending_traces = None
        if path.shape[1] > 1:   # one column: every row's root stays where it was written (row ctx_len)
            src, dst = compaction_indices_batch(path, path_len, ctx_lens)
            self.cache.move_rows(slots, src, dst)
        accepted = None   # what the WY commits of all layers share (one ancestor mask per forward)
        landing = None    # one-node blocks: where each row's new states go (see below)
        for state, trace in zip(self.cache.linear, traces or []):
            if not isinstance(trace, GdnTreeWYTrace) and trace.final_state is not None:
                # A one-node block (a decode step): the states after its root are the forward's, written in place.
                # A row that accepted nothing keeps its states: its new ones land in the scratch slot, which no
                # sequence holds, rather than the old ones being gathered to be written back (two 3 MB copies a
                # layer at the 27B's heads, on an `ar` step's path: its next forward waits for this commit).
                if landing is None:
                    landing = torch.where(path_len.to(slots.device) > 0, slots,
                                          torch.full_like(slots, self.cache.spec.scratch_slot))
                state.conv[landing] = trace.node_conv[:, 0]
                state.rec[landing] = trace.final_state
                continue
            if isinstance(trace, GdnTreeWYTrace):
                if accepted is None:
                    accepted = accepted_path(path, path_len, trace.anc.device)
                commit = None if self.hybrid_kernels is None else self.hybrid_kernels.commit_states
                conv, rec = gdn_commit_path_wy(trace, path, path_len, state.conv, state.rec, accepted, commit,
                                               state_index=slots)
            else:
                conv, rec = gdn_commit_path(trace, path, path_len, state.conv[slots], state.rec[slots],
                                            kernels=self.gdn_kernels_on)
            state.conv[slots] = conv
            state.rec[slots] = rec
