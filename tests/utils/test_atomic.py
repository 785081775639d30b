"""Atomic output: the target is replaced only by a complete file; failures leave nothing behind."""
import os

import pytest

from mindrlhf.utils.atomic import atomic_output


def test_success_replaces_the_target_with_ordinary_permissions(tmp_path):
    """A writer that leaves its file read-only (MindSpore's save_checkpoint: 0400) still gives a target with the
    permissions of a normally created file (0666 minus the umask), which can be overwritten and shared."""
    target = tmp_path / "sub" / "out.yaml"
    with atomic_output(target, ".yaml") as tmp:
        assert tmp.endswith(".yaml") and os.path.dirname(tmp) == str(target.parent)
        assert not target.exists()
        with open(tmp, "w") as f:
            f.write("new")
        os.chmod(tmp, 0o400)
    assert target.read_text() == "new"
    assert os.listdir(target.parent) == ["out.yaml"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_failure_keeps_the_old_file_and_removes_every_leftover(tmp_path):
    target = tmp_path / "model.ckpt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_output(target, ".ckpt") as tmp:
            open(tmp, "w").write("half")
            open(tmp[: -len(".ckpt")] + ".tmp", "w").write("writer's own temp")  # as save_checkpoint does
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["model.ckpt"]
