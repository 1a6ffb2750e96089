"""The shipped examples run as a new user would run them: the configs load, and
``examples/embed.py`` serves conversations whose cached bytes check out, and a
second run over the same disk directory starts from the pages the first left."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def test_example_configs_load_with_their_disk_beside_them():
    for name in ("kv.toml", "small.toml"):
        cfg = runtime.load_config(os.path.join(EXAMPLES, name))
        assert cfg.disk.path == os.path.join(EXAMPLES, "disk")


def _embed(disk: str) -> dict[str, int]:
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "embed.py"), "--disk-dir", disk,
                        "--conversations", "24", "--turns", "3"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = {tier: int(n) for n, tier in re.findall(r"(\d+) cached on (\w+)", r.stdout)}
    counts["wrong"] = int(re.search(r"wrong (\d+)", r.stdout).group(1))
    counts["checked"] = int(re.search(r"checked (\d+)", r.stdout).group(1))
    return counts


def test_embed_example_serves_checked_bytes_and_restarts_from_disk(tmp_path):
    disk = str(tmp_path / "made" / "here")        # made by the example
    first = _embed(disk)
    assert first["wrong"] == 0 and first["checked"] > 0 and first["disk"] == 0
    second = _embed(disk)
    assert second["wrong"] == 0 and second["disk"] > 0 and second["checked"] > first["checked"]
