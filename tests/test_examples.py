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
RUN = ["--conversations", "24", "--turns", "3"]

# embed.py's main, its model's expected pages made from the next block's key: every cached page
# it checks must read as wrong (a check that looked at less than the whole key would miss some)
WRONG_KEYS = """
import sys
sys.path.insert(0, sys.argv[1])
import embed, runtime
right = embed.expected_pages
embed.expected_pages = lambda keys, *a: right(keys[1:] + keys[:1], *a)
sys.exit(runtime.run(embed.main(embed.parse_args(sys.argv[2:]))))
"""


def test_example_configs_load_each_with_a_disk_directory_of_its_own():
    for name in ("kv", "small"):
        cfg = runtime.load_config(os.path.join(EXAMPLES, f"{name}.toml"))
        assert cfg.disk.path == os.path.join(EXAMPLES, "disk", name)


def _embed(*args: str, code: str | None = None) -> tuple[int, dict[str, int]]:
    cmd = [sys.executable, os.path.join(EXAMPLES, "embed.py"), *args] if code is None else \
        [sys.executable, "-c", code, EXAMPLES, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert "Traceback" not in r.stderr, r.stderr
    counts = {tier: int(n) for n, tier in re.findall(r"(\d+) cached on (\w+)", r.stdout)}
    counts["wrong"] = int(re.search(r"wrong (\d+)", r.stdout).group(1))
    counts["checked"] = int(re.search(r"checked (\d+)", r.stdout).group(1))
    return r.returncode, counts


def test_embed_example_serves_checked_bytes_and_restarts_from_disk(tmp_path):
    disk = str(tmp_path / "made" / "here")        # made by the example
    rc, first = _embed("--disk-dir", disk, *RUN)
    assert rc == 0 and first["wrong"] == 0 and first["checked"] > 0
    rc, second = _embed("--disk-dir", disk, *RUN)
    assert rc == 0 and second["wrong"] == 0 and second["disk"] > 0 and second["checked"] > first["checked"]


def test_embed_example_fails_on_a_page_of_another_block(tmp_path):
    disk = str(tmp_path / "disk")
    assert _embed("--disk-dir", disk, *RUN)[0] == 0
    rc, counts = _embed("--disk-dir", disk, *RUN, code=WRONG_KEYS)
    assert rc == 1 and counts["checked"] > 0 and counts["wrong"] == counts["checked"]
