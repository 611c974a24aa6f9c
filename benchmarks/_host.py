"""The CPU a benchmark ran on, for printing beside its figures: model, architecture, cores, and the
vector extensions that decide which code the native kernels' `-march=native` build uses."""

from __future__ import annotations

import os
import platform

_X86 = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile"]
_ARM = ["asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm"]
_ARM_PARTS = {("0x48", "0xd01"): "HiSilicon Kunpeng 920", ("0x41", "0xd40"): "Arm Neoverse V1",
              ("0x41", "0xd0c"): "Arm Neoverse N1", ("0x41", "0xd49"): "Arm Neoverse N2",
              ("0x41", "0xd4f"): "Arm Neoverse V2"}


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def describe() -> str:
    """E.g. 'AMD EPYC, x86_64, 2 cores: sse4_2 avx avx2 fma f16c (no AVX-512)'."""
    info, arch = _cpuinfo(), platform.machine()
    cores = os.cpu_count()
    if "flags" in info:
        flags = set(info["flags"].split())
        model = info.get("model name", platform.processor() or "unknown CPU")
        ext = [f for f in _X86 if f in flags]
        tail = "" if "avx512f" in flags else " (no AVX-512)"
    else:
        flags = set(info.get("Features", "").split())
        part = (info.get("CPU implementer", ""), info.get("CPU part", ""))
        model = _ARM_PARTS.get(part, f"implementer {part[0]} part {part[1]}" if part[0] else platform.processor())
        ext = [f for f in _ARM if f in flags]
        tail = "" if "sve" in flags or not flags else " (no SVE)"
    return f"{model}, {arch}, {cores} cores: {' '.join(ext) or 'no vector extensions listed'}{tail}"


if __name__ == "__main__":
    print(describe())
