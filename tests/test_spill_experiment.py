"""scripts/spill_experiment.py --quick: CSV columns and rows, sane hit rates, no corruption, a PNG."""
import csv
import importlib.util
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "spill_experiment.py")


def _load():
    spec = importlib.util.spec_from_file_location("spill_experiment", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod      # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod


def test_quick_sweep(tmp_path, capsys):
    mod = _load()
    rc = mod.main(["--quick", "--out", str(tmp_path), "--disk-dir", str(tmp_path / "disk"), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)

    with open(tmp_path / "spill.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == mod.COLUMNS
        rows = list(reader)
    assert len(rows) == len(printed) == 4
    assert {r["codec"] for r in rows} == {"concat", "int8"}
    for r in rows:
        for k in ("gpu_blocks", "host_blocks", "disk_blocks", "requests", "blocks", "verified_pages"):
            assert int(r[k]) > 0, (k, r)
        assert int(r["requests"]) == mod.QUICK_LIMIT
        assert int(r["corrupt_pages"]) == 0
        assert int(r["errors"]) == 0, r["error_kinds"]
        rates = {t: float(r[f"hit_rate_{t}"]) for t in ("gpu", "host", "disk")}
        total = float(r["hit_rate"])
        assert 0.0 <= total <= 1.0 and all(0.0 <= v <= 1.0 for v in rates.values())
        assert sum(rates.values()) == pytest.approx(total, abs=1e-5)
        assert int(r["pages_host_to_disk"]) > 0 and int(r["disk_bytes_written"]) > 0   # the disk tier was used
        into_disk = int(r["pages_host_to_disk"]) + int(r["pages_gpu_to_disk"])    # a full host tier is skipped
        assert int(r["disk_bytes_written"]) == into_disk * int(r["cold_page_bytes"])
        assert float(r["spill_mib_s"]) > 0
    # equal bytes: the same MiB, and int8's smaller cold pages buy more slots
    by = {(r["codec"], float(r["host_mib"]), float(r["disk_mib"])): r for r in rows}
    for (codec, hm, dm), r in by.items():
        if codec == "int8":
            c = by[("concat", hm, dm)]
            assert int(r["cold_page_bytes"]) < int(c["cold_page_bytes"])
            assert int(r["host_blocks"]) > int(c["host_blocks"]) and int(r["disk_blocks"]) > int(c["disk_blocks"])
    # more capacity never lowers the hit rate of a codec
    for codec in ("concat", "int8"):
        rs = sorted((r for r in rows if r["codec"] == codec),
                    key=lambda r: int(r["gpu_blocks"]) + int(r["host_blocks"]) + int(r["disk_blocks"]))
        rates = [float(r["hit_rate"]) for r in rs]
        assert rates == sorted(rates), (codec, rates)

    png = tmp_path / "spill.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
