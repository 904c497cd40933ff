"""Pin the CPU instruction set so that a run gives the same bits on AVX2 and AVX-512 machines (PROPOSED).

On the CPU, PyTorch (ATen's vectorised kernels), oneDNN and vLLM (its ``_C_AVX2`` / ``_C_AVX512`` kernels,
chosen by ``torch.cpu._is_avx512_supported()``) each pick code for the widest instruction set the machine
has. The sums then round differently, sampled episodes diverge, and the same seeded fit ends in different
weights on an AVX2 and an AVX-512 machine. Measured (2026-12-02) with the demo's OPD fit (``make
student-opd``, 20 steps): on an AVX-512 machine it gave sha256 9433ec32... unpinned (the same in two runs) and
7fed6085... with ATen, oneDNN and vLLM pinned to AVX2, which is the sha256 the same fit gave natively on an
AVX2-only machine. Setting MKL's ``MKL_CBWR=AVX2`` as well changed the result (7d29d20b...): MKL's default
branch on these AMD EPYC machines already matches, so MKL is left alone.
An experiment that continues one trained student over several sessions, on machines drawn at random, needs
that student rebuilt bit for bit, so ``make student-opd`` pins AVX2 (every x86-64 machine here has it).
The pin did not reproduce the student on another kind of CPU. Measured 2026-12-03 on an Intel Xeon (AVX-512,
KVM, 4 MiB L2): the pinned fit gave 1fa17abf..., and 25a06d9e... with ``MKL_ENABLE_INSTRUCTIONS=AVX2`` added;
neither is the AMD EPYC machines' 7fed6085... The two Intel fits' per-step metrics matched each other to the
printed 3 digits (20 steps), consistent with rounding differences; the cause (likely MKL's or oneDNN's kernel
and blocking choices, which depend on the CPU model and its caches) is not isolated. So far a student has to be
rebuilt on a CPU like the one that built it (:func:`cpu_name` is recorded beside its sha256 by the experiment
runner).

Set ``LIGHTNING_OPD_CPU_ISA=avx2`` and ``ATEN_CPU_CAPABILITY=avx2`` in the environment before Python starts
(ATen reads its variable once); :func:`pin_cpu_isa`, called by ``lightning-opd`` first thing, sets oneDNN's
variable (read at its first primitive) and hides AVX-512 from vLLM's kernel choice (in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` as the Makefile sets: a spawned engine process would not see the patch).
"""

from __future__ import annotations

import os

ENV = "LIGHTNING_OPD_CPU_ISA"
SUPPORTED = ("avx2",)
# torch.cpu feature probes vLLM consults to pick its kernels (vllm/platforms/cpu.py: import_kernels)
_WIDER = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported",
          "_is_vnni_supported")


def pin_cpu_isa(isa: str | None = None) -> str | None:
    """Pin ATen, oneDNN and vLLM's kernel choice to ``isa`` (default: ``$LIGHTNING_OPD_CPU_ISA``; unset: do nothing).

    Returns:
        the pinned instruction set (``"avx2"``), or ``None`` when nothing was asked.

    Raises:
        ValueError: ``isa`` is not one of :data:`SUPPORTED` (names the value).
        RuntimeError: ATen already runs wider kernels (``ATEN_CPU_CAPABILITY=avx2`` was not set before Python
            started), or the machine lacks AVX2.
    """
    isa = isa if isa is not None else os.environ.get(ENV)
    if not isa:
        return None
    isa = isa.lower()
    if isa not in SUPPORTED:
        raise ValueError(f"{ENV}={isa!r} is not supported; use one of {SUPPORTED} or unset it")
    import torch

    if not torch.cpu._is_avx2_supported():
        raise RuntimeError(f"{ENV}={isa}: this CPU has no AVX2; unset {ENV}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise RuntimeError(f"{ENV}={isa} but PyTorch runs {capability} kernels: also set ATEN_CPU_CAPABILITY=avx2 "
                           f"in the environment before Python starts (e.g. `ATEN_CPU_CAPABILITY=avx2 {ENV}=avx2 "
                           "lightning-opd fit ...`)")
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    for name in _WIDER:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _false)
    return isa


def cpu_name(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """This machine's CPU as ``/proc/cpuinfo`` (``cpuinfo_path``) names it: ``"<vendor_id> <model name>"``
    (e.g. ``"GenuineIntel Intel(R) Xeon(R) Processor"``); ``platform.processor()`` where ``/proc/cpuinfo`` is
    missing or names neither (e.g. some ARM machines), ``"unknown"`` if nothing says. Only the first processor's
    block is read. Never raises."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:  # the first processor's block is enough
                        break
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = " ".join(v for v in (fields.get("vendor_id"), fields.get("model name")) if v)
    if not name:
        import platform

        name = platform.processor()
    return name or "unknown"


def _false() -> bool:
    return False
