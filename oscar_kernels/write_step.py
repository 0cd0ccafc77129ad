"""Triton: a decode step's three write jobs of one layer in one launch (the vLLM backend's ``PagedInt2Layer.write``).

Only ``@triton.jit`` code lives here; the launcher and its checks are :func:`oscar_kernels.write_step_ops.write_step`.

The jobs are those of three separate launches, the same device code (:func:`int2_pack.quantize_write_tile`,
:func:`tier_copy.tier_write_tile`) on the same tiles, so the bytes written are the same: the keys quantized into
their pages (``rows`` layout, INT2 with its clip, or INT4 with the low plane), the values into theirs (token quads,
with their clip), and both rotated rows into the BF16 sink and ring tiers. The three write disjoint memory and read
only the step's inputs, so their order inside the launch does not matter. What one launch saves is two launches'
fixed cost per layer and step (the decode step's fixed cost over BF16: docs/VLLM.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_kernels.int2_pack import quantize_write_tile
from oscar_kernels.tier_copy import tier_write_tile


@triton.jit
def _write_step_kernel(
    # the keys' quantize_write_tile arguments (write_ops.WriteArgs.pointers(): rows, rotation, mean, slots, pages
    # in the rows layout, metadata, N, P, 0, clip index)
    k_ptr, stride_kn, stride_kh, k_r_ptr, stride_krh, k_mu_ptr, stride_kmun, stride_kmuh, k_slot_ptr,
    k_codes_ptr, stride_kcp, stride_kch, stride_kcr, k_scale_ptr, k_zero_ptr, stride_kmp, stride_kmh, stride_kmr,
    n_rows, page_size, k_row_tokens, k_clip_idx,
    # the values' (pages: the int32 view of the token quads)
    v_ptr, stride_vn, stride_vh, v_r_ptr, stride_vrh, v_mu_ptr, stride_vmun, stride_vmuh, v_slot_ptr,
    v_codes_ptr, stride_vcp, stride_vch, stride_vcr, v_scale_ptr, v_zero_ptr, stride_vmp, stride_vmh, stride_vmr,
    v_n_rows, v_page_size, row_tokens, v_clip_idx,
    k_lo_ptr,  # INT4 keys: the low plane (the key codes' layout); else any pointer
    sink_k_ptr, sink_v_ptr, stride_sr, stride_sh, stride_st,  # tiers, as tier_copy._tier_write_kernel's
    ring_k_ptr, ring_v_ptr, stride_rr, stride_rh, stride_rt,
    sink_row_ptr, sink_pos_ptr, ring_row_ptr, ring_slot_ptr,
    D: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    K_HAS_MU: tl.constexpr, V_HAS_MU: tl.constexpr, K_CLIP: tl.constexpr, V_CLIP: tl.constexpr, K_INT4: tl.constexpr,
    CLIP_SORT: tl.constexpr, TQ_XOR: tl.constexpr, EXCLUSIVE_WORDS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_T), H_kv, 3)``: axis 2 picks the job (0 keys, 1 values, 2 tiers). ``PDL``: let the
    next launch, when it is a programmatic dependent one (the decode's stage 1 reading the tiers in place), start
    right away; it waits for this grid (``griddepcontrol.wait``) before reading anything this writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid, h, job = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if job == 0:
        quantize_write_tile(pid, h, k_ptr, stride_kn, stride_kh, k_r_ptr, stride_krh, k_mu_ptr, stride_kmun,
                            stride_kmuh, k_slot_ptr, k_codes_ptr, stride_kcp, stride_kch, stride_kcr, k_scale_ptr,
                            k_zero_ptr, stride_kmp, stride_kmh, stride_kmr, n_rows, page_size, k_row_tokens,
                            k_clip_idx, k_lo_ptr, D=D, G=KG, BLOCK_T=BLOCK_T, HAS_R=False, HAS_MU=K_HAS_MU,
                            DO_CLIP=K_CLIP, TQ=False, CLIP_SORT=CLIP_SORT, TQ_XOR=TQ_XOR, EXCLUSIVE_WORDS=False,
                            INT4=K_INT4)
    elif job == 1:
        quantize_write_tile(pid, h, v_ptr, stride_vn, stride_vh, v_r_ptr, stride_vrh, v_mu_ptr, stride_vmun,
                            stride_vmuh, v_slot_ptr, v_codes_ptr, stride_vcp, stride_vch, stride_vcr, v_scale_ptr,
                            v_zero_ptr, stride_vmp, stride_vmh, stride_vmr, v_n_rows, v_page_size, row_tokens,
                            v_clip_idx, v_codes_ptr, D=D, G=VG, BLOCK_T=BLOCK_T, HAS_R=False, HAS_MU=V_HAS_MU,
                            DO_CLIP=V_CLIP, TQ=True, CLIP_SORT=CLIP_SORT, TQ_XOR=TQ_XOR,
                            EXCLUSIVE_WORDS=EXCLUSIVE_WORDS, INT4=False)
    else:
        tier_write_tile(pid, h, k_ptr, stride_kn, stride_kh, v_ptr, stride_vn, stride_vh, sink_k_ptr, sink_v_ptr,
                        stride_sr, stride_sh, stride_st, ring_k_ptr, ring_v_ptr, stride_rr, stride_rh, stride_rt,
                        sink_row_ptr, sink_pos_ptr, ring_row_ptr, ring_slot_ptr, n_rows,
                        D=D, BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T)
