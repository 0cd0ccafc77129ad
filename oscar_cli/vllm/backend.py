"""vLLM classes of oscar's INT2 attention backend (imported by vLLM only: this module imports vLLM).

``OscarInt2Backend`` (registered as ``CUSTOM`` by :mod:`oscar_cli.vllm.plugin`), its metadata builder and its
``AttentionImpl``. The work itself is in :mod:`oscar_cli.vllm.core` (tested without vLLM); this module adapts vLLM's
calls to it and refuses, at engine start, what it cannot serve (docs/VLLM.md).

Cache layout: one ``uint8 [num_blocks, block_size, H_kv, slot]`` tensor per layer (``slot = D/2 + 4·m`` bytes:
K and V codes, K and V scale/zero of ``m`` = 2 or 1 bytes; ``+ D/4`` for the keys' low plane on a layer with INT4
keys), carved into the kernels' paged K rows and V token quads by :func:`oscar_cli.vllm.layout.carve_pages` (and
:func:`~oscar_cli.vllm.layout.carve_low_plane`); vLLM's block manager sizes each layer's pool by its page
(:func:`int2_kv_cache_spec`): with INT4 keys on some layers the pages differ in size, and vLLM keeps one block table
for all layers (its ``UniformTypeKVCacheSpecs``), each layer's pool as large as its page needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from oscar_cli.errors import OscarError
from oscar_cli.vllm import debug, layout, warmup
from oscar_cli.vllm.core import PagedInt2Layer, Step, TritonKernels, build_step
from oscar_cli.vllm.spec import Int2KVSpec, slot_bytes

_log = logging.getLogger(__name__)
ARTIFACT_KEY = "oscar_artifact"


# ---------------------------------------------------------------------------------------------- engine settings
@dataclass(frozen=True)
class Runtime:
    """What every layer of this engine shares: the artifact's settings and transforms, and the tier rows."""

    ref: str
    settings: layout.Int2Settings
    layers: tuple[layout.LayerTensors, ...]
    num_rows: int
    block_size: int
    rope: layout.RopeFrequencies | None = None  # keys centred by position (quant.key_mean rope)


_RUNTIMES: dict[tuple[Any, ...], Runtime] = {}


def _load(vllm_config: Any, ref: str, num_kv_heads: int, head_dim: int, block_size: int, num_rows: int) -> Runtime:
    key = (ref, num_kv_heads, head_dim, block_size, num_rows)
    if key in _RUNTIMES:
        return _RUNTIMES[key]
    from oscar_cli.quant.methods import oscar_from_artifact

    cfg = vllm_config.model_config.hf_config
    with torch.device("cpu"):  # vLLM builds layers under a CUDA default device; the artifact is read on the CPU
        meth = oscar_from_artifact(ref, cfg)  # ArtifactError: missing, broken, or made for another model
    settings = layout.check_method(meth, head_dim=head_dim, block_size=block_size)
    tensors = layout.layer_tensors(meth, int(cfg.num_hidden_layers), num_kv_heads, head_dim)
    rope = (layout.rope_frequencies(cfg, head_dim, int(vllm_config.model_config.max_model_len))
            if meth.key_mean == "rope" else None)
    tiers = Int2KVSpec(num_kv_heads, head_dim, block_size, settings.meta_bytes, meth.sink,
                       meth.recent).sequence_tier_bytes
    _log.info("oscar: INT2 KV cache from %s (S0=%d, W=%d, %d-bit scale/zero, INT4 keys on layers %s); BF16 sink + "
              "recent tiers for %d sequences (--max-num-seqs): %.2f GB over %d layers", ref, meth.sink, meth.recent,
              8 * settings.meta_bytes, list(settings.int4_layers) or "none", num_rows,
              (num_rows + 1) * tiers * int(cfg.num_hidden_layers) / 1e9, int(cfg.num_hidden_layers))
    hint = layout.page_size_hint(block_size, meth.sink)
    if hint is not None:
        _log.info(hint)
    if rope is not None:
        _log.info("oscar: keys centred by position (quant.key_mean rope): RoPE scaling %.4g, position table of %d rows",
                  rope.scaling, rope.positions)
    rt = _RUNTIMES[key] = Runtime(ref, settings, tuple(tensors), num_rows, block_size, rope)
    return rt


def runtime(vllm_config: Any, num_kv_heads: int, head_dim: int) -> Runtime:
    """Validate the engine configuration for the INT2 backend and load the artifact (once per process)."""
    extra = vllm_config.additional_config
    ref = extra.get(ARTIFACT_KEY) if isinstance(extra, dict) else None
    if not ref:
        raise OscarError(f"oscar: --attention-backend CUSTOM needs an artifact: --additional-config "
                         f"'{{\"{ARTIFACT_KEY}\": \"hf://ORG/NAME@REV\"}}' (or a local artifact path)")
    reasons = []
    if vllm_config.cache_config.enable_prefix_caching:
        reasons.append("prefix caching (pass --no-enable-prefix-caching: the BF16 tiers are per request)")
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding")
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.decode_context_parallel_size != 1:
        reasons.append("tensor / decode-context parallelism (the artifact's per-head tensors are not sharded yet)")
    if reasons:
        raise OscarError("oscar INT2 backend does not support " + "; ".join(reasons))
    rows = int(vllm_config.scheduler_config.max_num_seqs)
    return _load(vllm_config, str(ref), num_kv_heads, head_dim, int(vllm_config.cache_config.block_size), rows)


def _install_page_size_hook() -> None:
    """Make layers running this backend report :func:`int2_kv_cache_spec` (vLLM 0.25 lets a backend choose its cache
    shape but not its page size; TurboQuant's cache dtypes get theirs from the same method). Idempotent; layers of
    other backends are untouched."""
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, "_oscar", False):
        return

    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        backend = getattr(self, "attn_backend", None)
        if isinstance(backend, type) and issubclass(backend, OscarInt2Backend):
            return int2_kv_cache_spec(self, vllm_config)
        return original(self, vllm_config)

    get_kv_cache_spec._oscar = True  # type: ignore[attr-defined]
    Attention.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]


def layer_slot_bytes(layer: Any) -> int:
    """Page bytes per token and KV head of an attention layer running this backend: its artifact's metadata bytes,
    and the low plane where the layer's keys are INT4 (``layer.impl`` holds the loaded :class:`Runtime`)."""
    rt: Runtime = layer.impl.rt
    idx = layout.layer_index(layer.layer_name)
    return slot_bytes(layer.head_size, rt.settings.meta_bytes, rt.settings.key_bits(idx))


def int2_kv_cache_spec(layer: Any, vllm_config: Any) -> Any:
    """The page of an INT2 layer: ``block_size · H_kv · slot`` bytes (TurboQuant's spec type, which vLLM already
    sizes by a per-slot byte count and groups with full attention; layers whose slots differ, INT4 keys on some,
    share one block table through vLLM's ``UniformTypeKVCacheSpecs``)."""
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    return TQFullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=layer.num_kv_heads,
                               head_size=layer.head_size, head_size_v=layer.head_size, dtype=torch.uint8,
                               tq_slot_size=layer_slot_bytes(layer))


# ---------------------------------------------------------------------------------------------- backend
class OscarInt2Backend(AttentionBackend):
    """oscar's INT2 KV cache: packed 2-bit K/V + scale/zero pages, BF16 sink and recent tiers per request."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to its enum member

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return list(layout.BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(layout.KERNEL_HEAD_DIMS)

    @staticmethod
    def get_impl_cls() -> type[OscarInt2Impl]:
        return OscarInt2Impl

    @staticmethod
    def get_builder_cls() -> type[OscarInt2MetadataBuilder]:
        return OscarInt2MetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # the slot is the layer's (int2_kv_cache_spec: metadata bytes, INT4 keys), which vLLM does not pass here: the
        # layer's buffer is exactly num_blocks pages, so its view infers it; _carve checks it against the layer's
        return (num_blocks, block_size, num_kv_heads, -1)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class OscarInt2Metadata(AttentionMetadata):
    step: Step


class OscarInt2MetadataBuilder(AttentionMetadataBuilder[OscarInt2Metadata]):
    """Once per step: tier rows of the batch's requests, recent lengths, token positions, decode lengths.

    Decode-only batches run in vLLM's full CUDA graphs: every tensor the forward reads is copied into a buffer
    allocated here once, at a fixed address. Requests are identified by the V2 runner's request slots, else by their
    first block id (see :meth:`_request_rows` and docs/VLLM.md).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        rt = runtime(vllm_config, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size)
        self.settings = rt.settings
        self.rows = layout.SequenceRows(rt.num_rows)
        self._checks_left = 3
        self._source: str | None = None  # "slots", "host" or "device": where request identities come from (logged once)
        self.recent_state = torch.zeros(rt.num_rows + 1, 2, dtype=torch.int32, device=device)
        sched = vllm_config.scheduler_config
        graphs = int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)
        reqs = max(int(sched.max_num_seqs), graphs)  # captured batches must fit: their buffers never move
        toks = max(int(sched.max_num_batched_tokens), reqs)
        i32, i64 = torch.int32, torch.int64
        self._bufs = {
            "rows": torch.zeros(reqs, dtype=i64, device=device),
            "recent_len": torch.zeros(reqs, dtype=i32, device=device),
            "sink_len": torch.zeros(reqs, dtype=i32, device=device),
            "hist_len": torch.zeros(reqs, dtype=i32, device=device),
            "ring_index": torch.zeros(reqs, max(rt.settings.ring, 1), dtype=i64, device=device),
            "req": torch.zeros(toks, dtype=i64, device=device),
            "pos": torch.zeros(toks, dtype=i64, device=device),
            **{name: torch.zeros(toks, dtype=i64, device=device)
               for name in ("sink_row", "sink_pos", "ring_row", "ring_slot")},
        }

    def _persist(self, st: Step) -> Step:
        for name, buf in self._bufs.items():
            t = getattr(st, name)
            if t.shape[0] > buf.shape[0]:  # never inside a captured graph: those batches fit the buffers
                buf = self._bufs[name] = torch.zeros(t.shape[0], *buf.shape[1:], dtype=buf.dtype, device=buf.device)
            view = buf[: t.shape[0]]
            view.copy_(t)
            setattr(st, name, view)
        return st

    def _step(self, cam: CommonAttentionMetadata, rows: list[int] | None) -> Step:
        t0 = time.perf_counter()
        capture = rows is not None
        qsl = cam.query_start_loc_cpu.tolist()
        seq_t = cam.seq_lens_cpu_upper_bound
        seq = (seq_t if seq_t is not None else cam.seq_lens.cpu()).tolist()[: cam.num_reqs]
        if rows is None:
            rows = self._request_rows(cam, qsl, seq)
        n = cam.num_actual_tokens
        st = build_step(cam.query_start_loc, qsl, cam.seq_lens, seq, cam.block_table_tensor, cam.slot_mapping[:n], n,
                        rows, self.recent_state, self.settings, cam.is_prefilling)
        st = self._persist(st)
        debug.STEPS.build(t0, cam.num_reqs, st.num_decodes, len(st.prefills), n, max(seq, default=0), capture)
        return st

    def _request_rows(self, cam: CommonAttentionMetadata, qsl: list[int], seq: list[int]) -> list[int]:
        """Tier rows of the batch's requests. Under vLLM's V2 model runner its request slots are the rows
        (:func:`~oscar_cli.vllm.layout.host_request_slots`: no device sync; the first builds check them against the
        device block table); otherwise rows are keyed by first block id (:meth:`_first_blocks`)."""
        n = cam.num_reqs
        if self._source in (None, "slots"):
            slots = layout.host_request_slots(n)
            if slots is not None:
                if self._source is None:
                    self._source = "slots"
                    debug.STEPS.note("oscar: request identities from the V2 runner's request slots")
                if self._checks_left > 0 and any(x >= 0 for x in slots):
                    layout.check_slots_against_blocks(slots, cam.block_table_tensor[:n, 0].tolist())  # host sync
                    self._checks_left -= 1
                return layout.rows_from_slots(slots, self.rows.num_rows, self.rows.scratch)
            if self._source == "slots":
                raise OscarError("oscar: vLLM's V2 model runner stopped passing its request slots to the INT2 "
                                 "backend mid-run; this vLLM version is not supported")
        first = self._first_blocks(cam)
        new = [seq[i] == qsl[i + 1] - qsl[i] for i in range(n)]
        return self.rows.assign(first, new)

    def _first_blocks(self, cam: CommonAttentionMetadata) -> list[int]:
        """The batch's first block ids (request identities). vLLM 0.25 keeps the block table on the host too (the
        device copy is made from it); the builder reads it from the calling model runner's frame, which costs no
        device sync. Where that is not found either, it reads the device table back: one sync per step, which waits
        for the previous step's GPU work. The first builds check the host copy against the device one and raise on a
        difference."""
        n = cam.num_reqs
        host = layout.host_first_blocks(n)
        if self._source is None:
            self._source = "host" if host is not None else "device"
            debug.STEPS.note(f"oscar: request identities from the {self._source} block table")
        if host is None or self._checks_left > 0:
            device = cam.block_table_tensor[:n, 0].tolist()  # host sync
            if host is not None and host != device:
                raise OscarError("oscar: vLLM's host block table differs from the device one; this vLLM version is "
                                 "not supported by the INT2 backend")
            if any(device):  # dummy batches (all null blocks) do not count as a check
                self._checks_left -= 1
            return device
        return host

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OscarInt2Metadata:
        return OscarInt2Metadata(self._step(common_attn_metadata, None))

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> OscarInt2Metadata:
        # dummy requests: every row is the scratch row (nothing real is read or written)
        return OscarInt2Metadata(self._step(common_attn_metadata, [self.rows.scratch] * common_attn_metadata.num_reqs))


# ---------------------------------------------------------------------------------------------- impl
def _flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """:data:`oscar_cli.vllm.core.Attend` through vLLM's FlashAttention (bottom-right causal: key ``offset + i`` is
    the last one query ``i`` sees)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    n, t = int(q.shape[0]), int(k.shape[0])
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, t], dtype=torch.int32, device=q.device)
    ver = get_flash_attn_version(head_size=int(q.shape[-1]))
    return flash_attn_varlen_func(q=q.contiguous(), k=k, v=v,
                                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=n, max_seqlen_k=t,
                                  softmax_scale=scale, causal=True, **({} if ver is None else {"fa_version": ver}))


class OscarInt2Impl(AttentionImpl[OscarInt2Metadata]):
    """Quantize-on-write + tiered attention for one layer (the work is :class:`~oscar_cli.vllm.core.PagedInt2Layer`)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **kwargs: Any) -> None:
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.rt = runtime(get_current_vllm_config(), self.num_kv_heads, head_size)
        layout.check_geometry(head_dim=head_size, block_size=self.rt.block_size, settings=self.rt.settings,
                              group_size=None, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                              alibi=alibi_slopes is not None, kv_sharing=kv_sharing_target_layer_name is not None)
        self.core: PagedInt2Layer | None = None
        self._pages: tuple[int, Any] | None = None
        self.key_bits = 2  # the layer's (set with the core, from the layer's index)

    def _core(self, layer: Any, query: torch.Tensor) -> PagedInt2Layer:
        if self.core is None:
            idx = layout.layer_index(layer.layer_name)
            self.key_bits = self.rt.settings.key_bits(idx)
            self.core = self._make_core(idx, self.rt.num_rows, query.dtype, query.device)
        return self.core

    def _make_core(self, idx: int, num_rows: int, dtype: torch.dtype, device: torch.device) -> PagedInt2Layer:
        """Layer ``idx``'s core with ``num_rows`` rows of BF16 tiers (the served one: the engine's request slots;
        the warm-up's copy: 2)."""
        kernels = TritonKernels(pdl=debug.pdl_override(), torch_rotate=debug.torch_rotate_forced(),
                                fused_write=debug.fused_write(), fused_gather=debug.fused_gather(),
                                direct_tiers=debug.direct_tiers())
        return PagedInt2Layer(self.rt.layers[idx], self.rt.settings, num_rows, self.num_heads, self.num_kv_heads,
                              self.head_size, self.rt.block_size, dtype, device, sm_scale=self.scale, kernels=kernels,
                              rope=self.rt.rope, key_bits=self.rt.settings.key_bits(idx))

    def _warm(self, layer: Any, core: PagedInt2Layer, device: torch.device) -> None:
        """Compile the eager steps' kernel variants now (``warmup.warm_once``: once per process and layer format)."""
        idx = layout.layer_index(layer.layer_name)
        s = self.rt.settings
        key = (core.key_bits, core.rope is not None, str(s.meta_dtype), str(core.act), self.num_heads,
               self.num_kv_heads, self.head_size, self.rt.block_size, s.sink, s.ring)
        warmup.warm_once(key, lambda rows: self._make_core(idx, rows, core.act, device), _flash_attend, device,
                         label=f"{core.key_bits}-bit keys, {self.rt.block_size}-token pages")

    def _carve(self, kv_cache: torch.Tensor) -> Any:
        key = kv_cache.data_ptr()
        if self._pages is None or self._pages[0] != key:
            if kv_cache.dim() != 4 or int(kv_cache.shape[1]) != self.rt.block_size:
                raise OscarError(f"oscar: KV cache {tuple(kv_cache.shape)} does not have the configured block size "
                                 f"{self.rt.block_size}")
            md = self.rt.settings.meta_dtype
            low = layout.carve_low_plane(kv_cache, self.head_size, md) if self.key_bits == 4 else None
            self._pages = (key, (*layout.carve_pages(kv_cache, self.head_size, md, self.key_bits), low))
        return self._pages[1]

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: OscarInt2Metadata, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("oscar INT2 backend: fused output quantization is not supported")
        assert output is not None
        core = self._core(layer, query)  # first call (the profiling run): the BF16 tiers are allocated here
        if attn_metadata is None:  # the profiling run (and vLLM's other dummy forwards)
            self._warm(layer, core, query.device)
            return output.fill_(0)
        k_pages, v_pages, k_low = self._carve(kv_cache)
        out = output.view(-1, self.num_heads, self.head_size)
        st = attn_metadata.step

        def run() -> None:
            core.forward(query.view(-1, self.num_heads, self.head_size),
                         key.view(-1, self.num_kv_heads, self.head_size), value.view(-1, self.num_kv_heads, self.head_size),
                         k_pages, v_pages, st, out, attend=_flash_attend, k_low=k_low)

        if debug.STEPS.enabled and layout.layer_index(layer.layer_name) == 0:
            debug.STEPS.forward(run, st.num_decodes, len(st.prefills), query.device)
        else:
            run()
        return output


_install_page_size_hook()
