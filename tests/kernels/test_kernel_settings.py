"""kernels/kernel_settings.py: the kernels' variables read through keepwarm.settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepwarm.kernels.kernel_settings import KernelSettings, kernel_settings
from keepwarm.settings import env_names


def test_defaults_leave_every_kernel_on_and_nothing_forced() -> None:
    assert kernel_settings({}) == KernelSettings(cpu_kernels=True, cpu_linear=True, isa="", prefill_form="")


@pytest.mark.parametrize("text, on", [("0", False), (" 0 ", False), ("1", True), ("yes", True), ("", True)])
def test_only_zero_switches_a_kernel_off(text: str, on: bool) -> None:
    got = kernel_settings({"KEEPWARM_CPU_KERNELS": text, "KEEPWARM_CPU_LINEAR": text})
    assert (got.cpu_kernels, got.cpu_linear) == (on, on)


def test_forced_build_and_form_are_read_as_given() -> None:
    got = kernel_settings({"KEEPWARM_CPU_KERNEL_BUILD": "avx2", "KEEPWARM_CPU_PREFILL_FORM": "fma"})
    assert (got.isa, got.prefill_form) == ("avx2", "fma")
    assert env_names(KernelSettings) == {
        "KEEPWARM_CPU_KERNELS",
        "KEEPWARM_CPU_LINEAR",
        "KEEPWARM_CPU_KERNEL_BUILD",
        "KEEPWARM_CPU_PREFILL_FORM",
        "KEEPWARM_KERNEL_DIR",
    }
    assert kernel_settings({}).kernel_dir is None  # the install's folder (prebuilt.kernel_root)
    assert kernel_settings({"KEEPWARM_KERNEL_DIR": "/opt/kw"}).kernel_dir == Path("/opt/kw")


def test_the_environment_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_CPU_LINEAR", "0")
    assert not kernel_settings().cpu_linear
    monkeypatch.delenv("KEEPWARM_CPU_LINEAR")
    assert kernel_settings().cpu_linear
