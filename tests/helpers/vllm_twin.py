"""A torch twin of the INT2 backend's kernel calls for model-free tests of ``oscar_cli.vllm.core`` (the simulated vLLM
runs of ``test_vllm_logic`` and the warm-up's ``test_vllm_warmup``), at the geometry those tests use."""

from __future__ import annotations

import torch

from oscar_cli.vllm.core import TorchTiers
from oscar_kernels import reference as ref

HQ, HKV, D = 4, 2, 64  # query heads, KV heads, head dim the twin's decode assumes
INV_FREQ = 1.0 / 10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # the rope runs' model RoPE


class TorchKernels(TorchTiers):
    """A torch twin of the kernel calls (reference quantizer + reference tiered attention; the tier copies of
    :class:`~oscar_cli.vllm.core.TorchTiers`), for long runs."""

    def quantize_write(self, x, cache, slots, mean, clip, layout_name, exclusive_words=False) -> None:
        mean = mean.transpose(0, 1) if mean.dim() == 3 else mean  # one mean per row (rope): [H, N, D]
        q = ref.quantize_rows(x.transpose(0, 1), None, mean, clip, None, cache.scale.dtype)  # [H, N, D/4]
        codes = ref.unpack_int2(q.packed)
        pg = int(cache.scale.shape[2])  # the page size (tokens)
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            page, off = divmod(slot, pg)
            cache.scale[page, :, off], cache.zero[page, :, off] = q.scale[:, i], q.zero[:, i]
            if layout_name == "rows":
                cache.packed[page, :, off] = q.packed[:, i]
            else:
                c = ref.unpack_token_quads(cache.packed[page], pg, D)
                c[:, off] = codes[:, i]
                cache.packed[page] = ref.pack_token_quads(c, ref.token_quad_row(pg))

    def decode(self, q, kp, vp, table, hist_len, sink, sink_len, recent, recent_len, t, scale, out, rope=None,
               low=None):
        """``low``: INT4 keys' low plane (paged): its logit term ``sm_scale·(scale/4)·(q·R_K)·lo`` joins the
        history's (formula 9 on top of the high plane in the pages)."""
        g, P = HQ // HKV, int(kp.scale.shape[2])  # (the page size from the pages)
        for b in range(q.shape[0]):
            hl, sl, rl = int(hist_len[b]), int(sink_len[b]), int(recent_len[b])
            pos = torch.arange(hl)
            pages = table[b].long()[pos // P]
            hk = ref.QuantizedRows(*(x[pages, :, pos % P].transpose(0, 1)[None] for x in (kp.packed, kp.scale, kp.zero)))
            vcodes = torch.zeros(HKV, 0, D, dtype=torch.uint8) if hl == 0 else torch.stack(
                [ref.unpack_token_quads(vp.packed[pg], P, D)[:, o] for pg, o in zip(pages, pos % P, strict=True)], 1)
            hv = ref.QuantizedRows(ref.pack_int2(vcodes.reshape(HKV, hl, D))[None],
                                   *(x[pages, :, pos % P].transpose(0, 1)[None] for x in (vp.scale, vp.zero)))
            rk = t.k_rotation.expand(HKV, D, D).repeat_interleave(g, 0)
            qr = torch.einsum("hd,hde->he", q[b].float(), rk)[None, :, None]
            bias = None
            if rope is not None:  # keys centred by position: their logit term, history slot n at position S0 + n
                pos_r = int(rope.position0[b]) + torch.arange(hl)[None]
                bias = ref.rope_mean_logits(q[b:b + 1], rope.mean_pre, INV_FREQ, rope.scaling, pos_r, scale)
            if low is not None:
                lo = ref.unpack_int2(low[pages, :, pos % P].transpose(0, 1)).float().repeat_interleave(g, 0)
                s4 = ref.decode_meta(hk.scale, hk.zero)[0][0, :, :, 0].repeat_interleave(g, 0) / 4  # [H_q, hl]
                term = (torch.einsum("hd,htd->ht", qr[0, :, 0], lo) * s4 * scale)[None].double()
                bias = term if bias is None else bias + term
            o = ref.decode_attention_reference(qr, sink[0][b:b + 1, :, :sl], sink[1][b:b + 1, :, :sl], hk, hv,
                                               recent[0][b:b + 1, :, :rl], recent[1][b:b + 1, :, :rl], scale,
                                               hist_bias=bias)
            o = o[0, :, 0] + t.v_mean.repeat_interleave(g, 0)
            rv = t.v_rotation.expand(HKV, D, D).repeat_interleave(g, 0)
            out[b] = torch.einsum("he,hde->hd", o, rv).to(out.dtype)
        return out
