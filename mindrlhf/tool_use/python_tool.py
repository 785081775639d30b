"""The built-in `python` tool: the model's code run by a fresh interpreter in a child process, with limits.

What it limits: CPU seconds, address space, the size of any file it writes (its output included), wall-clock time
(the child's whole process group is killed), the text returned; the child starts in an empty temporary folder that
is removed afterwards, in isolated mode (`-I`: no user site-packages, no PYTHON* variables), with an environment of
PATH and LANG only (no inherited secrets). What it does not protect against: the child runs as the job's user, so
it can read any file that user can read and write outside its folder, open network connections, and start other
processes; it is no sandbox for untrusted models. Run the job in a container or VM without credentials for that.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from mindrlhf.tool_use.calls import cut_answer

TIMEOUT_S = 10.0
CPU_S = 5
MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
MAX_OUTPUT_CHARS = 4000
# the child sets its own limits, then runs the code read from stdin (no preexec_fn: tools run in threads)
_BOOTSTRAP = """\
import resource, sys
cpu, memory, files = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
code = sys.stdin.read()
del resource, cpu, memory, files
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def run_python(code: str, timeout: float = TIMEOUT_S, cpu_seconds: int = CPU_S, memory_bytes: int = MEMORY_BYTES,
               file_bytes: int = FILE_BYTES, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """What `code` prints (stdout, cut at `max_chars`), or `error: ...` with the end of its stderr when it fails,
    runs out of CPU or memory, or exceeds `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="mindrlhf_python_tool_") as folder:
        out_path, err_path, work = (os.path.join(folder, name) for name in ("stdout", "stderr", "work"))
        os.mkdir(work)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, str(cpu_seconds), str(memory_bytes),
                                     str(file_bytes)], stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work,
                                    env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True)
            try:
                proc.communicate(code.encode("utf-8", "replace"), timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"error: the program did not finish within {timeout:g} s"
        stdout, stderr = (_read(path, max_chars) for path in (out_path, err_path))
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        return f"error: the program used more than {cpu_seconds} s of CPU"
    if proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if not line.startswith('  File "<string>"')]
        return "error: " + ("\n".join(lines[-5:]) if lines else f"the program exited with status {proc.returncode}")
    return stdout


def _read(path: str, max_chars: int) -> str:
    with open(path, "rb") as f:
        text = f.read(4 * max_chars + 4).decode("utf-8", "replace")
    return cut_answer(text, max_chars) or text


def python(code: str) -> str:
    """Runs a Python program in a fresh interpreter and returns what it prints.

    Args:
        code: The program; print the values you need, e.g. "print(1234 * 5678)".

    Returns:
        The printed text, or an error message.
    """
    return run_python(code)
