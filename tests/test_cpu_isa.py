"""lightning_opd.cpu_isa: pinning AVX2 so a seeded fit gives the same weights on AVX2 and AVX-512 machines."""

import os

import pytest
import torch

from lightning_opd import cli
from lightning_opd.cpu_isa import _WIDER, ENV, cpu_name, pin_cpu_isa


@pytest.fixture
def clean_env(monkeypatch):
    for name in (ENV, "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_unset_does_nothing(clean_env):
    before = torch.cpu._is_avx2_supported
    assert pin_cpu_isa() is None
    assert torch.cpu._is_avx2_supported is before
    assert "MKL_CBWR" not in os.environ


def test_unknown_isa_named(clean_env):
    clean_env.setenv(ENV, "avx512")
    with pytest.raises(ValueError, match=r"LIGHTNING_OPD_CPU_ISA='avx512' is not supported"):
        pin_cpu_isa()


def test_aten_running_wider_kernels_is_refused(clean_env):
    clean_env.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    clean_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(RuntimeError, match="ATEN_CPU_CAPABILITY=avx2"):
        pin_cpu_isa("avx2")


def test_pins_onednn_and_vllm_kernel_choice(clean_env):
    clean_env.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    clean_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    for name in _WIDER:  # every probe the pin replaces, so all are restored after the test
        clean_env.setattr(torch.cpu, name, lambda: True)
    assert pin_cpu_isa("AVX2") == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "MKL_CBWR" not in os.environ  # MKL's own branch matched the AVX2 machine's; CBWR changed the bits
    assert not torch.cpu._is_avx512_supported() and not torch.cpu._is_avx512_bf16_supported()
    assert not torch.cpu._is_amx_tile_supported()


def test_cli_refuses_a_bad_isa_before_any_work(clean_env):
    clean_env.setenv(ENV, "sse")
    with pytest.raises(ValueError, match="'sse'"):
        cli.main(["compare", "--help"])


def test_cpu_name_names_the_first_processor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n\n"
                       "processor\t: 1\nvendor_id\t: GenuineIntel\nmodel name\t: other\n")
    assert cpu_name(str(cpuinfo)) == "AuthenticAMD AMD EPYC 9B14"


def test_cpu_name_without_cpuinfo_never_raises(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.processor", lambda: "")
    arm = tmp_path / "cpuinfo"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")  # names no vendor/model
    assert cpu_name(str(arm)) == "unknown"
    assert cpu_name(str(tmp_path / "missing")) == "unknown"
    monkeypatch.setattr("platform.processor", lambda: "x86_64")
    assert cpu_name(str(tmp_path / "missing")) == "x86_64"
