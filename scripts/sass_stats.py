"""Instruction counts of the decode kernel's INT2 loop, compiled for sm_90 on any machine (no GPU needed).

Triton's bundled ptxas and nvdisasm turn the stage-1 kernel into SASS; the loops are found by their backward
branches and counted per opcode. Divided by the codes a loop iteration consumes, this is the "warp-instructions
per code" figure of docs/KERNELS.md. Usage:
    python scripts/sass_stats.py [--warps 1] [--block-n 64] [--gp 8] [--stages 2] [--block-nb 16] [--maxnreg 0]
        [--dtype bf16|fp16] [--hist-stages N] [--hoist-q] [--prefetch] [--page 64] [--sass out.sass]
        [--rope tf32x3|tf32|ieee]   (the position-dependent key mean's in-tile term, at that precision)
        [--meta8 bytes|words]   (formula 10's 8-bit scale/zero decoded in the tile, META8; words: DecodeConfig.meta_words)
        [--low-plane]   (INT4 keys: the low plane's codes read in the tile, HAS_LO)
    python scripts/sass_stats.py --merge HEADS
        (instead: the decode's merge + R_V kernel, ``int2_decode._merge_rotate_kernel``, HEADS query heads per
        program (DecodeConfig.merge_heads), Qwen3-8B's shape: registers, stack, FFMA, global loads, spills)
    python scripts/sass_stats.py --rotate-kv BLOCK_T [--warps 4]
        (instead: the vLLM backend's K/V rotation kernel, ``rotate_kv._rotate_kv_kernel``, at rows per program
        BLOCK_T, bf16 rows, D 128, BLOCK_E 32: registers, stack, and its local-memory spills (STL / LDL) against its
        float32 FMAs)
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from oscar_kernels import int2_decode, ops
from oscar_kernels.reference import token_quad_row

BIN = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin"
PTRS = {"kc_ptr": "*u8", "vc_ptr": "*u8", "bt_ptr": "*i32", "hist_len_ptr": "*i32", "sink_len_ptr": "*i32",
        "recent_len_ptr": "*i32", "op_ptr": "*fp32", "lse_ptr": "*fp32", "bias_ptr": "*fp32", "rm_ptr": "*fp32",
        "rt_ptr": "*fp32", "rl_ptr": "*fp16", "rpos_ptr": "*i32", "rope_scale": "fp32"}
# Opcodes Nsight Compute counts on the ALU pipe (integer logic, permutes, shifts, compares, selects, min/max): it
# issues at half the float pipe's rate, and it was what throttled the INT2 loop at batch 16 (docs/KERNELS.md)
ALU = ("LOP3", "PRMT", "SHF", "SEL", "FSEL", "FMNMX", "HMNMX2", "VHMNMX", "IMNMX", "ISETP", "FSETP", "PLOP3", "IADD3",
       "LEA")
INSN = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def compile_stage1(warps: int, block_n: int, gp: int, stages: int, block_nb: int = 16, maxnreg: int = 0,
                   act: str = "bf16", hist_stages: int = 0,
                   hoist_q: bool = False, prefetch: bool = False, page: int = 64, rope: str = "",
                   meta8: int = 0, low_plane: bool = False) -> object:
    fn = int2_decode._decode_stage1_kernel
    const = dict(H_KV=8, GROUP=4, GP=gp, D=128, BLOCK_N=block_n, BLOCK_NB=block_nb, PTX=True,
                 ACT=tl.float16 if act == "fp16" else tl.bfloat16, PAGED=True, PAGE=page,
                 VROW=token_quad_row(page) // 4,
                 TIER_PARTS=ops.TIER_PARTS, PDL=False, HIST_STAGES=hist_stages or stages,
                 HOIST_Q=hoist_q, PREFETCH=prefetch, HAS_ROPE=bool(rope), ROPE_PREC=rope or "tf32x3",
                 META8=meta8, HAS_LO=low_plane)
    ptrs = (PTRS | {"lo_ptr": "*u8", "lo_first_ptr": "*i32"}
            | ({n: "*u8" for n in ("ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr")} if meta8 else {}))
    opts = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return compile_sm90(fn, const, ptrs, ("num_splits", "rope_scale"), opts, "*fp16" if act == "fp16" else "*bf16")


def compile_sm90(fn: Any, const: dict[str, Any], types: dict[str, str], unaligned: tuple[str, ...],
                 options: dict[str, Any], default_ptr: str = "*bf16") -> object:
    """``fn`` compiled for sm_90 as the JIT specialises a launch: ``const`` and every other constexpr at its default
    (one left out would compile as a runtime argument, both sides of its branches, which need not type-check
    together), pointers ``types[name]`` (else ``default_ptr``), other arguments ``types[name]`` or i32, and every
    runtime argument but ``unaligned`` divisible by 16 (pointers, strides)."""
    const = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty} | const
    sig = {n: "constexpr" if n in const else types.get(n, default_ptr if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and n not in unaligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def compile_rotate_kv(block_t: int, warps: int = 4) -> object:
    """``rotate_kv._rotate_kv_kernel`` for sm_90 as ``ops.rotate_kv`` launches it on bf16 rows (D 128, BLOCK_E 32,
    8 KV heads, no query jobs)."""
    from oscar_kernels import rotate_kv

    const = dict(H_KV=8, D=128, BLOCK_T=block_t, BLOCK_E=32, Q_JOBS=False, GROUP=1, GP=16)
    types = {"rk_ptr": "*fp32", "rv_ptr": "*fp32", "rq_ptr": "*fp32", "qo_ptr": "*fp32", "qk_scale": "fp32"}
    return compile_sm90(rotate_kv._rotate_kv_kernel, const, types, ("n_rows", "t_tiles", "qk_scale", "n_q"),
                        {"num_warps": warps})


def rotate_kv_stats(block_t: int, warps: int = 4) -> dict[str, int]:
    """Registers, stack bytes and instruction counts (all, FFMA, spill stores STL, spill loads LDL) of
    :func:`compile_rotate_kv`'s SASS."""
    regs, stack, ops_ = opcodes(compile_rotate_kv(block_t, warps).asm["cubin"])  # type: ignore[attr-defined]
    return {"block_t": block_t, "registers": regs, "stack_bytes": stack, "instructions": sum(ops_.values()),
            "ffma": ops_["FFMA"], "stl": ops_["STL"], "ldl": ops_["LDL"]}


def compile_merge(heads: int, e_prog: int = 128) -> object:
    """``int2_decode._merge_rotate_kernel`` for sm_90 as a large batch's decode plan launches it on Qwen3-8B's shape
    (32 query heads over 8 KV heads, D 128, ``R_V`` and ``mu_V``, ``E_PROG`` all of D, 20 partials), with ``HEADS``
    query heads per program (``DecodeConfig.merge_heads``)."""
    const = dict(H_Q=32, GROUP=4, D=128, SP=32, BLOCK_E=32, BLOCK_P=64, HAS_MU=True, HAS_R=True, E_PROG=e_prog,
                 PDL=True, HEADS=heads)
    return compile_sm90(int2_decode._merge_rotate_kernel, const, {"out_ptr": "*bf16"}, ("n_parts",),
                        {"num_warps": 4}, "*fp32")


def merge_stats(heads: int) -> dict[str, int]:
    """Registers, stack bytes and instruction counts (all, FFMA, global loads LDG, spills STL / LDL) of
    :func:`compile_merge`'s SASS."""
    regs, stack, ops_ = opcodes(compile_merge(heads).asm["cubin"])  # type: ignore[attr-defined]
    return {"heads": heads, "registers": regs, "stack_bytes": stack, "instructions": sum(ops_.values()),
            "ffma": ops_["FFMA"], "ldg": ops_["LDG"], "stl": ops_["STL"], "ldl": ops_["LDL"]}


def opcodes(cubin: bytes) -> tuple[int, int, collections.Counter]:
    """(registers, stack bytes, count of every opcode) of a whole kernel's SASS."""
    sass = tool("nvdisasm", "-c", cubin=cubin)
    regs, stack = resources(cubin)
    return regs, stack, collections.Counter(m.group(2).split(".")[0] for m in map(INSN.match, sass.splitlines()) if m)


def tool(name: str, *args: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / name), *args, f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the cubin's kernel, from ``cuobjdump``; -1 each if not found."""
    usage = re.search(r"REG:(\d+).*?STACK:(\d+)", tool("cuobjdump", "--dump-resource-usage", cubin=cubin))
    return (int(usage.group(1)), int(usage.group(2))) if usage else (-1, -1)


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(instruction count, opcode histogram) of every loop body (a backward branch to a label)."""
    ins, addr_of, label = [], {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.?(L_x_\d+):", line.strip())
        if m:
            label = m.group(1)
            continue
        m = INSN.match(line)
        if m:
            a = int(m.group(1), 16)
            if label:
                addr_of[label], label = a, None
            ins.append((a, m.group(2), m.group(3)))
    out = []
    for a, op, rest in ins:
        t = re.search(r"(L_x_\d+)", rest)
        if op.startswith("BRA") and t and addr_of.get(t.group(1), a) < a:
            body = [o.split(".")[0] for x, o, _ in ins if addr_of[t.group(1)] <= x <= a]
            out.append((len(body), collections.Counter(body)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warps", type=int, default=1)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--gp", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--hist-stages", type=int, default=0, help="pipelining depth of the INT2 loop (0: --stages)")
    p.add_argument("--hoist-q", action="store_true", help="q operands converted before the loop (DecodeConfig.hoist_q)")
    p.add_argument("--prefetch", action="store_true", help="L2 prefetch before the wait (DecodeConfig.prefetch)")
    p.add_argument("--block-nb", type=int, default=16)
    p.add_argument("--page", type=int, default=64, help="tokens per page (paged layout)")
    p.add_argument("--maxnreg", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rope", choices=("", "tf32x3", "tf32", "ieee", "fp16"), default="",
                   help="compile the position-dependent key mean's in-tile term (HAS_ROPE) at this dot precision")
    p.add_argument("--meta8", choices=("", "bytes", "words"), default="",
                   help="8-bit scale/zero decoded in the tile (META8), loaded as byte tiles or 32-bit words")
    p.add_argument("--low-plane", action="store_true", help="INT4 keys' low plane read in the tile (HAS_LO)")
    p.add_argument("--sass", type=Path)
    p.add_argument("--rotate-kv", type=int, metavar="BLOCK_T", help="the K/V rotation kernel at BLOCK_T rows instead")
    p.add_argument("--merge", type=int, metavar="HEADS", help="the decode's merge + R_V kernel, HEADS query heads per "
                   "program, instead")
    a = p.parse_args()
    if a.merge:
        st = merge_stats(a.merge)
        print(f"triton {triton.__version__}, sm_90, merge HEADS {st['heads']}, 4 warp(s): {st['registers']} registers, "
              f"stack {st['stack_bytes']} B; {st['instructions']} instructions, {st['ffma']} FFMA, {st['ldg']} LDG, "
              f"spills {st['stl']} STL + {st['ldl']} LDL")
        return
    if a.rotate_kv:
        st = rotate_kv_stats(a.rotate_kv, a.warps)
        print(f"triton {triton.__version__}, sm_90, rotate_kv BLOCK_T {st['block_t']}, {a.warps} warp(s): "
              f"{st['registers']} registers, stack {st['stack_bytes']} B; {st['instructions']} instructions "
              f"({st['instructions'] / st['block_t']:.1f} per row), {st['ffma']} FFMA, spills {st['stl']} STL + "
              f"{st['ldl']} LDL")
        return
    k = compile_stage1(a.warps, a.block_n, a.gp, a.stages, a.block_nb, a.maxnreg, a.dtype, a.hist_stages, a.hoist_q,
                       a.prefetch, a.page, a.rope, ("", "bytes", "words").index(a.meta8), a.low_plane)
    cubin = k.asm["cubin"]  # type: ignore[attr-defined]
    sass = tool("nvdisasm", "-c", cubin=cubin)
    if a.sass:
        a.sass.write_text(sass)
    regs, stack = resources(cubin)
    print(f"triton {triton.__version__}, sm_90: {regs} registers, stack {stack} B; {a.warps} warp(s), "
          f"BLOCK_N {a.block_n}, GP {a.gp}")
    codes = a.block_n * 128 * 2  # K and V codes one INT2 iteration consumes (D = 128)
    for n, hist in loops(sass):
        kind = "INT2" if hist.get("LOP3", 0) + hist.get("PRMT", 0) > 150 else "BF16"  # the unpack's and/permute
        alu = sum(hist.get(op, 0) for op in ALU)
        print(f"{kind} loop: {n} instructions/warp/iteration"
              + (f" = {n * a.warps / codes:.4f} warp-instructions per code" if kind == "INT2" else "")
              + f", {alu} on the integer pipe", dict(hist.most_common(16)))


if __name__ == "__main__":
    main()
