"""`refitctl read --at-version` against a real refitd: the live version reads,
another is exit 5 (ABORTED) naming both versions."""

from __future__ import annotations

from conftest import refitctl

NAME = "model.layers.0.mlp.down_proj.weight"


def test_read_at_the_live_version(daemon, tmp_path):
    out = tmp_path / "t.bin"
    read = refitctl(daemon.address, "read", NAME, "--at-version", "1", "--out", str(out))
    assert read.returncode == 0, read.stderr
    assert out.stat().st_size == 128 * 352


def test_read_at_another_version_is_a_conflict(daemon):
    read = refitctl(daemon.address, "read", NAME, "--at-version", "7", "--out", "/dev/null")
    assert read.returncode == 5, read.stderr
    assert "pinned to version 7 but version 1 is live" in read.stderr
