"""What this CPU can do, decided once: the level every CPU kernel, weight packing and build flag asks for.

The levels of an x86 CPU, lowest first:

- `x86_64`: none of the below (the portable kernels only).
- `avx2`: AVX2 and FMA (Zen 2/3, Intel's AVX2 cores since Haswell). oneDNN refuses bf16 here (torch's bf16
  path needs AVX512BW/VL/DQ, or AVX-NE-CONVERT, which this level does not count on), so bf16 weights are
  multiplied in fp32: from an fp32 copy, or as they are by the AVX2 kernel for a few rows (npu_llm_kernels/cpu.py).
- `avx512`: AVX-512 F/BW/VL/DQ (Skylake-SP, Cascade Lake): the AVX-512 decode kernel; bf16 weights multiplied
  in fp32 as at avx2 (oneDNN would emulate bf16, at about a quarter of its fp32 speed).
- `avx512_bf16`: AVX512-BF16 too (Zen 4/5, Cooper Lake): bf16 multiplied in hardware.
- `amx`: AMX tiles (Sapphire Rapids and later): oneDNN's bf16 matmuls run on AMX.

An Arm CPU is `aarch64` (Kunpeng 920 on Atlas servers): the portable kernels, vectorized with NEON. Any other
architecture is `portable`: the portable kernels, built with the compiler's defaults.

`NPU_LLM_CPU_ISA` lowers the level (never above the host's), for every kernel choice and for the extension's
build: how a CPU with AMX runs, and tests, the paths an AVX2-only CPU takes.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

X86_LEVELS = ("x86_64", "avx2", "avx512", "avx512_bf16", "amx")
ARM_LEVELS = ("aarch64",)
OTHER_LEVELS = ("portable",)
ENV = "NPU_LLM_CPU_ISA"

# The extension's builds and their GCC flags, one per level but amx: AMX is oneDNN's, so amx builds as
# avx512_bf16. A build names the instruction sets of its level, not `-march=native`, so that a binary built on one
# machine runs on any of its level (a home directory shared by an AMX node and an AVX2 node); and only those the
# level checks for (not x86-64-v3's BMI2 or MOVBE, say, which a VM may hide). 512-bit vectors made the norms and
# rotary 15% faster on AVX-512 CPUs, where GCC would otherwise prefer 256.
_AVX2 = ["-march=x86-64", "-mavx2", "-mfma", "-mtune=native"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
BUILDS = {
    "x86_64": ["-march=x86-64", "-mtune=native"],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],
    "aarch64": [],  # armv8-a: NEON is always there, and GCC vectorizes with it
    "portable": [],
}

# What each level means for a bf16 model, for the start-up log and `doctor`.
MEANING = {
    "x86_64": "portable kernels; bf16 weights computed in fp32",
    "avx2": "AVX2 kernels; bf16 weights computed in fp32 (oneDNN has no bf16 without AVX-512)",
    "avx512": "AVX-512 kernels; bf16 weights computed in fp32 (no bf16 hardware)",
    "avx512_bf16": "AVX-512 kernels; bf16 matmuls in hardware (AVX512-BF16)",
    "amx": "AVX-512 kernels; bf16 matmuls on AMX tiles",
    "aarch64": "portable kernels with NEON; bf16 weights computed by torch",
    "portable": "portable kernels; bf16 weights computed by torch",
}


@dataclass(frozen=True)
class CpuFeatures:
    level: str  # the level the kernels use: the host's, or lower where NPU_LLM_CPU_ISA says so
    host: str  # the highest level this CPU supports

    def at_least(self, level: str) -> bool:
        levels = _levels_of(self.host)
        return level in levels and levels.index(self.level) >= levels.index(level)

    @property
    def x86(self) -> bool:
        """Whether oneDNN's x86 matmuls pack the weights (on aarch64 torch's own F.linear runs)."""
        return self.level in X86_LEVELS

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN's bf16 reorder and matmul run: AVX512BW/VL/DQ, and torch's own check agrees (it says no
        where ONEDNN_MAX_CPU_ISA holds oneDNN below AVX-512)."""
        return self.at_least("avx512") and torch.ops.mkldnn._is_mkldnn_bf16_supported()

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 is multiplied in hardware (AVX512-BF16 or AMX)."""
        return self.at_least("avx512_bf16") and self.onednn_bf16

    @property
    def vnni(self) -> bool:
        """Whether int8 dot products run in hardware (AVX512-VNNI): oneDNN's int8 GEMM is exact and fast only there."""
        return self.at_least("avx512") and torch.cpu._is_vnni_supported()

    @property
    def build(self) -> str:
        """The extension build this level runs (a key of BUILDS)."""
        return "avx512_bf16" if self.level == "amx" else self.level

    def describe(self) -> str:
        lowered = f", lowered from {self.host} by {ENV}" if self.level != self.host else ""
        return f"CPU level {self.level}{lowered}: {MEANING[self.level]}"


def _levels_of(level: str) -> tuple[str, ...]:
    return next(levels for levels in (X86_LEVELS, ARM_LEVELS, OTHER_LEVELS) if level in levels)


def host_level() -> str:
    """The highest level this CPU supports (cpuinfo, through torch; ATEN_CPU_CAPABILITY does not change it)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    if machine not in ("x86_64", "amd64"):
        return "portable"
    if torch.cpu._is_avx512_supported():  # F, BW, VL and DQ
        if torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported():
            return "amx"
        return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    return "avx2" if torch.cpu._is_avx2_supported() else "x86_64"


def levels_up_to_host() -> tuple[str, ...]:
    """Every level this machine can run, lowest first (what the tests run each CPU kernel at)."""
    host = host_level()
    levels = _levels_of(host)
    up_to_host = levels[: levels.index(host) + 1]
    # x86_64 alone where it is the host's: above it, avx2 runs the same portable kernels, vectorized
    return up_to_host[1:] if len(up_to_host) > 1 and up_to_host[0] == "x86_64" else up_to_host


def distinct_levels_up_to_host() -> tuple[str, ...]:
    """levels_up_to_host less the levels that choose exactly what a higher one does (x86_64 and avx2 may run the
    same portable kernels): the levels a test suite needs to run. avx512_bf16 and amx are one build but pack bf16
    matmul weights differently (our stripes, oneDNN's AMX layout): both run."""
    chosen: dict[tuple, str] = {}
    for level in levels_up_to_host():
        features = CpuFeatures(level, host_level())
        chosen[(features.build, features.onednn_bf16, features.native_bf16, level == "amx")] = level
    return tuple(chosen.values())


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU level, decided at the first call (tests clear the cache to change it)."""
    return choose(host_level(), os.environ.get(ENV, ""))


def choose(host: str, asked: str) -> CpuFeatures:
    """The level `asked` (NPU_LLM_CPU_ISA's value; empty for the host's) on a CPU whose level is `host`."""
    asked = asked.strip().lower()
    if not asked:
        return CpuFeatures(host, host)
    levels = _levels_of(host)
    if asked not in levels:
        raise ValueError(f"{ENV}={asked!r}: expected one of {', '.join(levels)}")
    if levels.index(asked) > levels.index(host):
        raise ValueError(f"{ENV}={asked}: this CPU's level is {host}, and a level above it would run "
                         "instructions the CPU does not have")
    return CpuFeatures(asked, host)
