"""Every results JSON a benchmark writes names its machine: the CPU model (``cpu_name()``, not ``x86_64``) and the
cores this process may run on (issue 61)."""

from __future__ import annotations

import json
import os
import platform

from benchmarks import common
from benchmarks.common import ResultFile, machine, write_json
from lightning_opd.cpu_isa import cpu_name


def test_machine_names_the_cpu_model_and_the_cores_granted():
    """On the test machine ``cpu_name()`` reads ``/proc/cpuinfo`` (vendor + model name), which is never the
    architecture ``platform.machine()`` gives; cores are those of the affinity mask."""
    m = machine()
    assert m == {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))}
    assert m["cpu"] not in (platform.machine(), "unknown", "")


def test_result_file_stamps_each_entry_with_the_machine(tmp_path, monkeypatch):
    """``put`` adds ``cpu`` and ``cores`` to a dict entry, on disk too; an entry that already names its machine (one
    measured elsewhere and rewritten here) keeps it; a non-dict value is stored as given."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "cpu_name", lambda: "GenuineIntel Intel(R) Xeon(R) Test")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    results = ResultFile("r")
    results.put("a", {"median_s": 1.5})
    results.put("b", {"median_s": 2.0, "cpu": "AuthenticAMD AMD EPYC", "cores": 2})
    results.put("c", [1, 2])
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk == {"a": {"median_s": 1.5, "cpu": "GenuineIntel Intel(R) Xeon(R) Test", "cores": 3},
                       "b": {"median_s": 2.0, "cpu": "AuthenticAMD AMD EPYC", "cores": 2}, "c": [1, 2]}
    assert ResultFile("r").data == on_disk  # resumable: a rerun reads it back


def test_write_json_stamps_the_document(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "cpu_name", lambda: "GenuineIntel Intel(R) Xeon(R) Test")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    write_json(tmp_path / "sub" / "out.json", {"runs": [{"kl": 3.1}]})
    assert json.loads((tmp_path / "sub" / "out.json").read_text()) == {
        "runs": [{"kl": 3.1}], "cpu": "GenuineIntel Intel(R) Xeon(R) Test", "cores": 2}
