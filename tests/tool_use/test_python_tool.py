"""The built-in python tool: the program's printed text, or an error text when it fails or passes a limit; no
inherited environment, an empty folder of its own."""
import os
import time

from mindrlhf.tool_use import load_tools
from mindrlhf.tool_use.python_tool import run_python


def test_the_program_prints_its_answer_in_an_empty_folder_without_the_jobs_environment(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    assert run_python("print(1234 * 5678)") == "7006652\n"
    seen = run_python("import os, sys; print(sorted(os.environ), os.listdir('.'), sys.flags.isolated)")
    assert seen == "['LANG', 'PATH'] [] 1\n"
    folder = run_python("import os; print(os.getcwd())").strip()
    assert not os.path.exists(folder) and "mindrlhf_python_tool_" in folder


def test_failures_and_limits_answer_with_an_error_text():
    assert run_python("1 / 0") == ('error: Traceback (most recent call last):\n  File "<tool>", line 1, in <module>\n'
                                   'ZeroDivisionError: division by zero')
    assert run_python("while True: pass", cpu_seconds=1) == "error: the program used more than 1 s of CPU"
    assert run_python("x = bytearray(2 << 30)", memory_bytes=1 << 30).endswith("MemoryError")
    assert run_python("open('f', 'w').write('z' * (2 << 20))").endswith("OSError: [Errno 27] File too large")
    assert run_python("print('y' * 100000)", max_chars=50) == "y" * 50 + "\n... (cut at 50 characters)"
    started = time.monotonic()
    assert run_python("import time; time.sleep(30)", timeout=1) == "error: the program did not finish within 1 s"
    assert time.monotonic() - started < 5


def test_python_is_a_built_in_tool():
    (tool,) = load_tools(["python"])
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    assert tool.function("print(sum(range(10)))") == "45\n"
