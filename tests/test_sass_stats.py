"""scripts/sass_stats.py --rotate-kv: the K/V rotation kernel compiled for sm_90 on a CPU machine (Triton's bundled
ptxas, nvdisasm and cuobjdump), with its registers, stack and spill instructions read from the cubin. Run as a
subprocess: the tests' Triton interprets kernels (``TRITON_INTERPRET=1``), which compiles nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_stats.py"), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_rotate_kv_decode_tile_does_not_spill() -> None:
    """The 16-row tile the launcher uses up to 64 tokens keeps its operands in registers: no stack, no local-memory
    spills (the 64-row tile spilled 7 KB per thread with Triton 3.9: docs/VLLM.md)."""
    stdout = _run("--rotate-kv", "16", "--warps", "4")
    m = re.search(r"rotate_kv BLOCK_T 16, 4 warp\(s\): (\d+) registers, stack (\d+) B; (\d+) instructions .*?"
                  r"(\d+) FFMA, spills (\d+) STL \+ (\d+) LDL", stdout)
    assert m, stdout
    regs, stack, insns, ffma, stl, ldl = map(int, m.groups())
    assert 0 < regs <= 255 and stack == 0 and stl == 0 and ldl == 0 and 0 < ffma < insns


def test_stage1_compiles_and_counts_its_int2_loop() -> None:
    """The decode's stage 1 at the script's defaults: every constexpr the script does not set compiles at its
    default (one passed as a runtime argument compiles both sides of its branches, which failed for DIRECT_TIERS),
    and the INT2 loop is found and counted."""
    stdout = _run()
    assert re.search(r"sm_90: \d+ registers, stack \d+ B", stdout), stdout
    assert re.search(r"INT2 loop: \d+ instructions/warp/iteration = [0-9.]+ warp-instructions per code", stdout), stdout


@pytest.mark.parametrize("heads", [1, 4], ids=["one-head", "four-heads"])
def test_merge_heads_keep_their_operands_in_registers(heads: int) -> None:
    """The merge + ``R_V`` kernel with one and with four query heads a program (``DecodeConfig.merge_heads``;
    Qwen3-8B's shape): no stack and no local-memory spills, 64-128 FMAs per head (the rotation back of each
    head's output; Triton 3.9: 96 for one head, 304 for four)."""
    stdout = _run("--merge", str(heads))
    m = re.search(rf"merge HEADS {heads}, 4 warp\(s\): (\d+) registers, stack (\d+) B; (\d+) instructions, (\d+) FFMA,"
                  r" (\d+) LDG, spills (\d+) STL \+ (\d+) LDL", stdout)
    assert m, stdout
    regs, stack, insns, ffma, ldg, stl, ldl = map(int, m.groups())
    assert 0 < regs <= 255 and stack == 0 and stl == 0 and ldl == 0 and 0 < ffma < insns and ldg > 0
    assert (ffma >= 64 * heads) and (ffma <= 128 * heads)
