"""`mindrlhf.utils.checkpoint_file.read_checkpoint`: MindSpore's loader with its memory check counting what the host
can give."""
import os

import numpy as np
import pytest

from mindrlhf.utils import checkpoint_file


def test_a_checkpoint_loads_when_free_pages_are_few_but_the_host_can_give_the_memory(tmp_path, monkeypatch):
    """MindSpore's `load_checkpoint` refuses a file larger than the host's free pages (`SC_AVPHYS_PAGES`, without the
    page cache): with 1 MiB free it refuses a 4 MiB file, which `read_checkpoint` loads (the host's MemAvailable);
    a file larger than what the host can give is still refused, and MindSpore's check is left as it was."""
    import mindspore as ms
    from mindspore.train import serialization

    values = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    path = str(tmp_path / "w.ckpt")
    checkpoint_file.write_checkpoint([("w", values)], path)
    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 256 if name == "SC_AVPHYS_PAGES" else sysconf(name))
    with pytest.raises(ValueError, match="exceeds current available memory"):
        ms.load_checkpoint(path)
    check = serialization._get_available_memory
    np.testing.assert_array_equal(checkpoint_file.read_checkpoint(path)["w"].asnumpy(), values)
    total = sysconf("SC_PHYS_PAGES") * sysconf("SC_PAGE_SIZE")
    assert 4 << 20 < checkpoint_file.available_memory_bytes() <= total

    monkeypatch.setattr(checkpoint_file, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match="exceeds current available memory 1048576 bytes"):
        checkpoint_file.read_checkpoint(path)
    assert serialization._get_available_memory is check
