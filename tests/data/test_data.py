"""Data pipeline: JSON/JSONL/Parquet (a file or a folder) -> MindRecord conversion, templates, the prompt reader,
the CLI, the sample data."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from support import paths
from support.msrun import run_command

from mindrlhf.cli import prepare_data
from mindrlhf.configs.generation import bucket_length
from mindrlhf.data.answers import extract_gold_answer
from mindrlhf.data.mindrecord import (
    DEFAULT_OUTPUT_NAME,
    DataError,
    convert_to_mindrecord,
    mindrecord_output_path,
    read_problems,
)
from mindrlhf.data.reader import PromptDataset, read_prompt_records
from mindrlhf.data.templates import R1_THINK_SYSTEM_PROMPT, build_prompt
from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer

ROOT = str(paths.ROOT)
TINY_DIR = str(paths.TOKENIZER)
SAMPLE_DIR = str(paths.TUTORIAL_DATA)
SAMPLE = str(paths.GSM8K_SAMPLE)

PROBLEMS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 5 boxes?", "answer": "12 * 5 = 60\n#### 60"},
    {"question": "Lin reads 20 pages a day. How many pages in a week?", "answer": "20 * 7 = 140\n#### 140"},
    {"question": "What is 1,000 - 1?", "answer": "#### 999"},
    {"question": "学生有 30 人，走了 5 人，还剩几人？", "answer": "30 - 5 = 25\n#### 25"},
]
LONG_PROBLEM = {"question": "Count the numbers: " + " ".join(str(i) for i in range(200)), "answer": "#### 200"}


@pytest.fixture(scope="module")
def tokenizer() -> Qwen2Tokenizer:
    return Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), os.path.join(TINY_DIR, "merges.txt"))


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)) + "\n")
    return str(path)


def make_mindrecord(tmp_path, tokenizer, num: int, name: str = "prompts.mindrecord") -> str:
    """A MindRecord with `num` raw-template prompts of varied lengths ("q<i>" repeated i % 7 + 1 times)."""
    records = [{"question": " ".join([f"q{i}"] * (i % 7 + 1)), "answer": f"#### {i}"} for i in range(num)]
    source = write_jsonl(tmp_path / f"{name}.jsonl", records)
    output = str(tmp_path / name)
    convert_to_mindrecord(source, output, tokenizer, template="raw", max_prompt_length=100)
    return output


# ---------------------------------------------------------------- templates

def test_templates():
    question = "What is 6 * 7?"
    assert build_prompt(question, "raw") == question
    chat = build_prompt(question, "qwen_chat")
    assert chat == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    r1 = build_prompt(question, "r1_think")
    assert r1.startswith(f"<|im_start|>system\n{R1_THINK_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{question}")
    assert "<think>" in R1_THINK_SYSTEM_PROMPT and "<answer>" in R1_THINK_SYSTEM_PROMPT
    with pytest.raises(ValueError, match="unknown prompt template 'chatml'"):
        build_prompt(question, "chatml")
    # `chat` and `r1_think` go through the tokenizer's renderer; `qwen_chat` is Qwen2.5's whatever the tokenizer
    render = lambda messages: "|".join(m["role"] + ":" + m["content"] for m in messages)
    assert build_prompt(question, "chat", render) == f"user:{question}"
    assert build_prompt(question, "r1_think", render) == f"system:{R1_THINK_SYSTEM_PROMPT}|user:{question}"
    assert build_prompt(question, "qwen_chat", render) == chat == build_prompt(question, "chat")


def test_non_numeric_answers_only_when_allowed(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [PROBLEMS[0], {"question": "Name a colour", "answer": "blue"}])
    with pytest.raises(DataError, match=rf"^{re.escape(source)}:2: 'answer' has no gold number"):
        list(read_problems(source))
    assert [p.answer for p in read_problems(source, numeric_answers=False)] == [PROBLEMS[0]["answer"], "blue"]


MATH_SOLUTIONS = [
    "The side is $\\sqrt{12}$, so the answer is $\\boxed{2\\sqrt{3}}$.",
    "Halving, $\\theta = \\boxed{\\frac{\\pi}{2}}$.",
    "The point is $\\boxed{(1, 2)}$.",
    "Solving, $x \\in \\boxed{[1, 2)}$ and nothing else.",
]


def test_math_boxed_latex_answers_need_no_flag(tmp_path, tokenizer):
    from mindrlhf.reward.rules import accuracy_reward

    source = write_jsonl(tmp_path / "math.jsonl", [{"problem": f"p{i}?", "solution": s}
                                                   for i, s in enumerate(MATH_SOLUTIONS)])
    output = str(tmp_path / "math.mindrecord")
    assert prepare_data.main(["--tokenizer_dir", TINY_DIR, "--file_path", source, "--output_path", output,
                              "--template", "raw", "--prompt_key", "problem", "--answer_key", "solution"]) == 0
    solutions = read_prompt_records(output)[1]
    assert solutions == MATH_SOLUTIONS  # stored as given: accuracy reads the \boxed{} from it
    completions = ["<answer>\\sqrt{12}</answer>", "\\boxed{\\pi/2}", "<answer>(1,2)</answer>", "<answer>[1,2]</answer>"]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("answer", ["blue", "#### x + 1", "\\boxed{}", "it is \\boxed{ } or so", "\\boxed{x",
                                    "\\boxed{\\sqrt{2}}\n#### many"])
def test_answers_neither_numeric_nor_boxed_are_still_refused(tmp_path, answer):
    source = write_jsonl(tmp_path / "d.jsonl", [PROBLEMS[0], {"question": "q?", "answer": answer}])
    with pytest.raises(DataError, match=rf"^{re.escape(source)}:2: 'answer' has no gold number the accuracy reward "
                                        r"can parse \(expected '#### 42', '\\boxed\{42\}' or a bare number, or a "
                                        r"LaTeX answer in '\\boxed\{\.\.\.\}'\), got "):
        list(read_problems(source))
    assert [p.answer for p in read_problems(source, numeric_answers=False)] == [PROBLEMS[0]["answer"], answer]


# ---------------------------------------------------------------- conversion

@pytest.mark.parametrize("template", ["qwen_chat", "r1_think", "raw"])
@pytest.mark.parametrize("layout", ["jsonl", "json_list"])
def test_conversion_round_trip(tmp_path, tokenizer, template, layout):
    records = PROBLEMS + [LONG_PROBLEM]
    source = tmp_path / ("data.jsonl" if layout == "jsonl" else "data.json")
    if layout == "jsonl":
        write_jsonl(source, records)
    else:
        source.write_text(json.dumps(records, ensure_ascii=False, indent=2), encoding="utf-8")
    output = str(tmp_path / "out" / "prompts.mindrecord")
    stats = convert_to_mindrecord(str(source), output, tokenizer, template=template, max_prompt_length=250)
    assert (stats.written, stats.dropped_too_long, stats.bad_lines) == (5, 1, 0)

    expected_ids = [tokenizer.encode(build_prompt(p["question"], template)) for p in PROBLEMS]
    assert stats.longest_prompt == max(len(ids) for ids in expected_ids)
    prompt_ids, solutions = read_prompt_records(output)
    assert [ids.tolist() for ids in prompt_ids] == expected_ids
    assert solutions == [p["answer"] for p in PROBLEMS]

    from mindspore.mindrecord import FileReader
    reader = FileReader(output, num_consumer=1)
    rows = list(reader.get_next())
    reader.close()
    assert [int(r["prompt_length"]) for r in rows] == [len(ids) for ids in expected_ids]
    assert [r["prompt"] for r in rows] == [build_prompt(p["question"], template) for p in PROBLEMS]
    assert sorted(os.listdir(tmp_path / "out")) == ["prompts.mindrecord", "prompts.mindrecord.db"]


def test_the_instruction_follows_each_question_inside_the_user_turn(tmp_path, tokenizer):
    from mindrlhf.data.templates import GSM8K_INSTRUCTION
    output = str(tmp_path / "p.mindrecord")
    assert prepare_data.main(["--vocab_path", os.path.join(TINY_DIR, "vocab.json"), "--merges_file_path",
                           os.path.join(TINY_DIR, "merges.txt"), "--file_path",
                           write_jsonl(tmp_path / "d.jsonl", PROBLEMS), "--output_path", output,
                           "--template", "qwen_chat", "--instruction", "gsm8k"]) == 0
    prompt_ids, _ = read_prompt_records(output)
    expected = [build_prompt(p["question"] + " " + GSM8K_INSTRUCTION, "qwen_chat") for p in PROBLEMS]
    assert [ids.tolist() for ids in prompt_ids] == [tokenizer.encode(text) for text in expected]
    assert expected[0].index(GSM8K_INSTRUCTION) < expected[0].index("<|im_end|>\n<|im_start|>assistant")


def test_a_flag_prefix_is_refused_in_one_line(capsys):
    """Flags are matched exactly: `--file` is not taken for `--file_path`."""
    with pytest.raises(SystemExit) as stop:
        prepare_data.build_parser().parse_args(["--file", "x.jsonl", "--output_path", "o"])
    assert stop.value.code == 2
    error, see = capsys.readouterr().err.splitlines()  # prog: error: ..., see prog --help (prog: argv[0])
    assert error.endswith(": error: the following arguments are required: --file_path") and see.endswith(" --help")


def test_room_for_a_mindrecord_is_checked_before_writing():
    from mindrlhf.data.mindrecord import MIB, mindrecord_room_problem

    assert mindrecord_room_problem(10 * MIB, 1000 * MIB, None) is None
    assert mindrecord_room_problem(10 * MIB, 1000 * MIB, 48 * MIB) is None  # header + one page
    assert "is 47.0 MiB and this MindRecord file is 48 MiB long" in mindrecord_room_problem(10 * MIB, 1000 * MIB,
                                                                                             47 * MIB)
    assert "file is 80 MiB long" in mindrecord_room_problem(40 * MIB, 1000 * MIB, 64 * MIB)  # two pages
    assert mindrecord_room_problem(10 * MIB, 10 * MIB, None) == \
        "the disk has 10.0 MiB free and this MindRecord needs about 24.0 MiB"


def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """`ulimit -f 30000` on the data step: MindSpore's writer would crash the process (SIGSEGV) after creating its
    staging folder; the tool names the file and the limit, exits 2 and leaves the folder as it was."""
    script = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "rlhf_data.py")
    tokenizer_flags = ["--vocab_path", os.path.join(TINY_DIR, "vocab.json"), "--merges_file_path",
                       os.path.join(TINY_DIR, "merges.txt")]
    done = run_command(["bash", "-c", 'ulimit -f 30000 && exec "$0" "$@"', sys.executable, script, *tokenizer_flags,
                        "--file_path", write_jsonl(tmp_path / "d.jsonl", PROBLEMS), "--output_path",
                        str(tmp_path / "out" / "p.mindrecord")], None, 300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'out' / 'p.mindrecord'}: cannot write it: the file size limit (ulimit -f) is 29.3 MiB "
        "and this MindRecord file is 48 MiB long (MindSpore reserves a 16 MiB header and 32 MiB pages; the disk "
        "holds only what is written)")
    assert os.listdir(tmp_path / "out") == []


def test_a_mindrecord_cut_short_is_one_line_with_the_cause(tmp_path, tokenizer):
    """A prompt file whose write or copy did not finish: MindSpore's reader fails with a multi-line report ending in
    a C++ stack; the error names the file, MindSpore's own message and the likely cause."""
    path = make_mindrecord(tmp_path, tokenizer, 2)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(DataError) as info:
        read_prompt_records(path)
    assert str(info.value) == (f"{path}: cannot read MindRecord file (Failed to read file.): it is damaged or cut "
                               "short (a write or copy that did not finish?); write it again with "
                               "examples/qwen_grpo_tutorial/rlhf_data.py")


def test_long_prompts_are_dropped_not_truncated(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    lengths = [len(tokenizer.encode(p["question"])) for p in PROBLEMS]
    limit = sorted(lengths)[2]  # a prompt of exactly `limit` tokens is kept
    stats = convert_to_mindrecord(source, str(tmp_path / "o.mindrecord"), tokenizer, template="raw",
                                  max_prompt_length=limit)
    assert stats.written == sum(n <= limit for n in lengths)
    assert stats.dropped_too_long == sum(n > limit for n in lengths) > 0
    prompt_ids, solutions = read_prompt_records(str(tmp_path / "o.mindrecord"))
    assert [len(ids) for ids in prompt_ids] == [n for n in lengths if n <= limit]
    assert solutions == [p["answer"] for p, n in zip(PROBLEMS, lengths) if n <= limit]
    with pytest.raises(DataError, match="no prompt left to write"):
        convert_to_mindrecord(source, str(tmp_path / "none.mindrecord"), tokenizer, template="raw",
                              max_prompt_length=1)


BAD_LINES = [
    (PROBLEMS[0], None),
    ("{not json", "invalid JSON"),
    ({"prompt": "x", "answer": "#### 1"}, "missing key 'question' (keys present: ['answer', 'prompt']); choose them "
                                           "with --prompt_key / --answer_key (run_grpo.sh: PROMPT_KEY / ANSWER_KEY)"),
    ({"question": 5, "answer": "#### 5"}, "'question' must be a string, got int"),
    ({"question": "q", "answer": ["#### 5"]}, "'answer' must be a string, got list"),
    ('["a list"]', "expected a JSON object, got list"),
    ({"question": "   ", "answer": "#### 5"}, "'question' is empty"),
    ({"question": "q", "answer": "about a dozen"}, "'answer' has no gold number the accuracy reward can parse"),
    (PROBLEMS[1], None),
]


@pytest.mark.parametrize("bad_index", [i for i, (_, message) in enumerate(BAD_LINES) if message])
def test_bad_line_error_names_file_and_line(tmp_path, tokenizer, bad_index):
    record, message = BAD_LINES[bad_index]
    source = write_jsonl(tmp_path / "d.jsonl", ["", PROBLEMS[0], record])  # blank line 1 still counts
    with pytest.raises(DataError) as info:
        convert_to_mindrecord(source, str(tmp_path / "o.mindrecord"), tokenizer)
    assert str(info.value).startswith(f"{source}:3: ")
    assert message in str(info.value)
    assert not os.path.exists(tmp_path / "o.mindrecord")


def test_skip_bad_lines_counts_them(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [record for record, _ in BAD_LINES])
    stats = convert_to_mindrecord(source, str(tmp_path / "o.mindrecord"), tokenizer, skip_bad_lines=True)
    assert (stats.written, stats.bad_lines) == (2, 7)
    assert [m.split(": ", 1)[0] for m in stats.bad_line_messages] == [f"{source}:{n}" for n in range(2, 9)]
    assert read_prompt_records(str(tmp_path / "o.mindrecord"))[1] == [PROBLEMS[0]["answer"], PROBLEMS[1]["answer"]]


def test_json_list_errors_give_the_item_line(tmp_path):
    source = tmp_path / "d.json"
    source.write_text('[\n  {"question": "a", "answer": "1"},\n\n  {"question": 3,\n   "answer": "2"}\n]\n',
                      encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}:4: 'question' must be a string"):
        list(read_problems(str(source)))
    source.write_text('[{"question": "a", "answer": "1"},\n {"question": "b" "answer": "2"}]', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}:2: invalid JSON in the list"):
        list(read_problems(str(source), skip_bad_lines=True))  # cannot resync inside a list: always fatal
    source.write_text('[{"question": "a", "answer": "1"}] trailing', encoding="utf-8")
    with pytest.raises(DataError, match="unexpected text after the end of the JSON list"):
        list(read_problems(str(source)))
    source.write_text("[]", encoding="utf-8")
    assert list(read_problems(str(source))) == []


def test_custom_keys_and_missing_input(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "solution": "#### 2"}])
    problems = list(read_problems(source, prompt_key="problem", answer_key="solution"))
    assert [(p.line, p.question, p.answer) for p in problems] == [(1, "1+1?", "#### 2")]
    with pytest.raises(DataError, match=r"nope\.jsonl: input data file not found"):
        list(read_problems(str(tmp_path / "nope.jsonl")))


def test_overwrite_replaces_old_output(tmp_path, tokenizer):
    output = str(tmp_path / "o.mindrecord")
    convert_to_mindrecord(write_jsonl(tmp_path / "a.jsonl", PROBLEMS), output, tokenizer)
    convert_to_mindrecord(write_jsonl(tmp_path / "b.jsonl", PROBLEMS[:2]), output, tokenizer)
    assert read_prompt_records(output)[1] == [p["answer"] for p in PROBLEMS[:2]]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".mindrecord-tmp")]


# ---------------------------------------------------------------- input folders and Parquet

def write_parquet(path, records) -> str:
    import pyarrow as pa  # only these tests need it
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def write_mixed_folder(folder) -> list[dict]:
    """A folder of one .jsonl, one .json list and one .parquet file (created out of name order) and files that
    are not inputs; returns the problems in the order the folder is read (sorted file names)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_parquet(folder / "c_train-00000.parquet", PROBLEMS[3:5])
    write_jsonl(folder / "b_extra.jsonl", PROBLEMS[1:3])
    (folder / "a_first.json").write_text(json.dumps(PROBLEMS[:1], ensure_ascii=False), encoding="utf-8")
    (folder / "notes.txt").write_text("not data", encoding="utf-8")
    write_jsonl(folder / ".hidden.jsonl", [{"question": "hidden?", "answer": "#### 1"}])
    (folder / "nested").mkdir()
    write_jsonl(folder / "nested" / "d.jsonl", [{"question": "nested?", "answer": "#### 2"}])
    return PROBLEMS[:1] + PROBLEMS[1:3] + PROBLEMS[3:5]


def test_a_folder_of_json_jsonl_and_parquet_becomes_one_mindrecord_in_name_order(tmp_path, tokenizer):
    expected = write_mixed_folder(tmp_path / "raw")
    output = str(tmp_path / "o.mindrecord")
    stats = convert_to_mindrecord(tmp_path / "raw", output, tokenizer, template="qwen_chat")
    assert [os.path.basename(name) for name in stats.input_files] == ["a_first.json", "b_extra.jsonl",
                                                                      "c_train-00000.parquet"]
    assert (stats.written, stats.bad_lines, stats.output_path) == (5, 0, output)
    prompt_ids, solutions = read_prompt_records(output)
    assert solutions == [p["answer"] for p in expected]
    assert [ids.tolist() for ids in prompt_ids] == [tokenizer.encode(build_prompt(p["question"], "qwen_chat"))
                                                    for p in expected]
    problems = list(read_problems(tmp_path / "raw"))
    assert [(os.path.basename(p.source), p.line) for p in problems] == [
        ("a_first.json", 1), ("b_extra.jsonl", 1), ("b_extra.jsonl", 2), ("c_train-00000.parquet", 0),
        ("c_train-00000.parquet", 1)]


def test_the_tutorial_command_with_an_input_folder_and_an_output_folder(tmp_path, tokenizer):
    expected = write_mixed_folder(tmp_path / "raw")
    script = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "rlhf_data.py")
    out_dir = tmp_path / "mindrecord"  # does not exist yet: the trailing '/' makes it a folder
    proc = run_command([sys.executable, script, "--vocab_path", os.path.join(TINY_DIR, "vocab.json"),
                        "--merges_file_path", os.path.join(TINY_DIR, "merges.txt"),
                        "--file_path", f"{tmp_path / 'raw'}/", "--output_path", f"{out_dir}/"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = out_dir / DEFAULT_OUTPUT_NAME
    assert sorted(os.listdir(out_dir)) == [DEFAULT_OUTPUT_NAME, DEFAULT_OUTPUT_NAME + ".db"]
    assert f"written: 5, dropped too long (> 512 tokens): 0, bad lines: 0 -> {written}" in proc.stderr
    assert "read 3 files: " in proc.stderr and proc.stdout == ""
    assert read_prompt_records(str(written))[1] == [p["answer"] for p in expected]

    # an existing folder (no trailing '/') again means <folder>/prompts.mindrecord; the old pair is replaced
    one_file = write_jsonl(tmp_path / "one.jsonl", PROBLEMS[:2])
    stats = convert_to_mindrecord(one_file, out_dir, tokenizer)
    assert stats.output_path == str(written)
    assert read_prompt_records(str(written))[1] == [p["answer"] for p in PROBLEMS[:2]]
    assert sorted(os.listdir(out_dir)) == [DEFAULT_OUTPUT_NAME, DEFAULT_OUTPUT_NAME + ".db"]


def test_output_path_names_a_file_or_a_folder(tmp_path):
    assert mindrecord_output_path(tmp_path / "x.mindrecord") == str(tmp_path / "x.mindrecord")
    assert mindrecord_output_path(tmp_path) == str(tmp_path / DEFAULT_OUTPUT_NAME)
    assert mindrecord_output_path(f"{tmp_path}/new/") == str(tmp_path / "new" / DEFAULT_OUTPUT_NAME)
    assert mindrecord_output_path("rel.mindrecord") == os.path.abspath("rel.mindrecord")


def test_gsm8k_and_math_parquet_files(tmp_path, tokenizer):
    gsm8k = write_parquet(tmp_path / "train-00000-of-00001.parquet", [
        {"question": "Ann has 40 pens and buys 2 more. How many pens?", "answer": "40 + 2 = <<40+2=42>>42\n#### 42"}])
    output = str(tmp_path / "gsm8k.mindrecord")
    convert_to_mindrecord(gsm8k, output, tokenizer)
    solutions = read_prompt_records(output)[1]
    assert solutions == ["40 + 2 = <<40+2=42>>42\n#### 42"]  # stored as given, like JSON input
    assert extract_gold_answer(solutions[0]) == 42  # the gold number the accuracy reward compares with

    math = write_parquet(tmp_path / "math.parquet", [
        {"problem": "What is $\\frac{3}{6}$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
         "type": "Prealgebra"}])
    problems = list(read_problems(math, prompt_key="problem", answer_key="solution"))
    assert [(p.line, p.question, p.columns) for p in problems] == [
        (0, "What is $\\frac{3}{6}$?", {"level": "Level 1", "type": "Prealgebra"})]
    assert extract_gold_answer(problems[0].answer) == 0.5


def test_input_folder_and_parquet_errors_name_the_file(tmp_path, tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no data here", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: no input data file in this folder "
                                        r"\(expected files ending with \.json, \.jsonl, \.parquet"):
        convert_to_mindrecord(empty, str(tmp_path / "o.mindrecord"), tokenizer)

    math = write_parquet(tmp_path / "math.parquet", [{"problem": "1+1?", "solution": "\\boxed{2}"}])
    with pytest.raises(DataError, match=rf"^{re.escape(math)}: no column 'question', 'answer' "
                                        r"\(columns present: \['problem', 'solution'\]\); choose them with "
                                        r"--prompt_key / --answer_key \(run_grpo.sh: PROMPT_KEY / ANSWER_KEY\)$"):
        list(read_problems(math, skip_bad_lines=True))  # a whole file without the column: always fatal

    nulls = write_parquet(tmp_path / "nulls.parquet", [PROBLEMS[0], {"question": "q?", "answer": None}])
    with pytest.raises(DataError, match=rf"^{re.escape(nulls)}:row 1: 'answer' must be a string"):
        list(read_problems(nulls))

    not_parquet = tmp_path / "broken.parquet"
    not_parquet.write_text("not parquet at all", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(not_parquet))}: cannot read as Parquet"):
        list(read_problems(not_parquet))


def test_a_bad_line_in_the_second_file_names_that_file(tmp_path, tokenizer):
    folder = tmp_path / "raw"
    folder.mkdir()
    write_jsonl(folder / "part1.jsonl", PROBLEMS[:2])
    second = write_jsonl(folder / "part2.jsonl", [PROBLEMS[2], "{broken", PROBLEMS[3]])
    output = tmp_path / "o.mindrecord"
    with pytest.raises(DataError, match=rf"^{re.escape(second)}:2: invalid JSON"):
        convert_to_mindrecord(folder, str(output), tokenizer)
    assert not output.exists()
    stats = convert_to_mindrecord(folder, str(output), tokenizer, skip_bad_lines=True)
    assert (stats.written, stats.bad_lines) == (4, 1)
    assert stats.bad_line_messages[0].startswith(f"{second}:2: invalid JSON")
    assert read_prompt_records(str(output))[1] == [p["answer"] for p in PROBLEMS[:4]]


def test_parquet_without_pyarrow_says_to_install_it(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", PROBLEMS[:1])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: reading Parquet needs pyarrow.*pip install pyarrow=="):
        list(read_problems(path))
    assert [p.question for p in read_problems(write_jsonl(tmp_path / "d.jsonl", PROBLEMS[:1]))] == [
        PROBLEMS[0]["question"]]  # JSON input never imports it


# ---------------------------------------------------------------- reader

def test_bucket_length():
    assert bucket_length(5, None) == 5
    assert bucket_length(5, []) == 5
    assert bucket_length(5, [4, 8, 16]) == 8
    assert bucket_length(8, [4, 8, 16]) == 8
    assert bucket_length(0, [4, 8]) == 4
    with pytest.raises(ValueError, match="longer than the largest length bucket 16"):
        bucket_length(17, [4, 8, 16])


def test_batches_are_left_padded_with_mask_and_bucket(tmp_path, tokenizer):
    path = make_mindrecord(tmp_path, tokenizer, 12)
    all_ids, solutions = read_prompt_records(path)
    pad = tokenizer.pad_token_id
    dataset = PromptDataset(path, batch_size=4, pad_token_id=pad, shuffle=False, length_buckets=[8, 16, 32])
    assert len(dataset) == 3
    for batch in dataset:
        samples = batch["sample_index"]
        lengths = [len(all_ids[s]) for s in samples]
        assert batch["prompt_ids"].shape == (4, bucket_length(max(lengths), [8, 16, 32]))
        assert batch["prompt_ids"].dtype == np.int32 and batch["attention_mask"].dtype == np.int32
        assert batch["prompt_length"].tolist() == lengths
        assert batch["solution"] == [solutions[s] for s in samples]
        for row, sample in enumerate(samples):
            n = lengths[row]
            assert batch["prompt_ids"][row, -n:].tolist() == all_ids[sample].tolist()
            assert (batch["prompt_ids"][row, :-n] == pad).all()
            assert batch["attention_mask"][row].tolist() == [0] * (batch["prompt_ids"].shape[1] - n) + [1] * n
    assert dataset.epoch == 1
    unbucketed = PromptDataset(path, batch_size=4, pad_token_id=pad, shuffle=False).next_batch()
    assert unbucketed["prompt_ids"].shape[1] == max(unbucketed["prompt_length"])


def test_dp_ranks_get_disjoint_parts_of_the_global_batch(tmp_path, tokenizer):
    path = make_mindrecord(tmp_path, tokenizer, 20)
    common = dict(batch_size=3, pad_token_id=0, seed=5, length_buckets=[8, 16, 32])
    ranks = [PromptDataset(path, dp_rank=r, dp_size=2, **common) for r in range(2)]
    whole = PromptDataset(path, batch_size=6, pad_token_id=0, seed=5, length_buckets=[8, 16, 32])
    assert len(ranks[0]) == len(whole) == 3
    seen = []
    for _ in range(len(whole)):
        parts = [rank.next_batch() for rank in ranks]
        reference = whole.next_batch()
        assert not set(parts[0]["sample_index"]) & set(parts[1]["sample_index"])
        assert np.concatenate([p["sample_index"] for p in parts]).tolist() == reference["sample_index"].tolist()
        assert parts[0]["prompt_ids"].shape == parts[1]["prompt_ids"].shape == (3, reference["prompt_ids"].shape[1])
        assert np.array_equal(np.concatenate([p["prompt_ids"] for p in parts]), reference["prompt_ids"])
        seen += reference["sample_index"].tolist()
    assert len(set(seen)) == 18  # 20 prompts, global batch 6, drop_last: 2 left out this epoch


def test_other_dataset_fields_follow_their_prompt_into_the_batches(tmp_path, tokenizer, caplog):
    """Fields besides question/answer are kept per record (any JSON value) and come out with their prompt on
    every dp rank; names the trainer passes itself are dropped with one warning; older files give {}."""
    from mindrlhf.data.mindrecord import MINDRECORD_SCHEMA, write_mindrecord_atomically

    records = [{"question": f"q{i} " * (i % 3 + 1), "answer": f"#### {i}", "level": i, "tags": ["t", i % 2],
                "solution": "dropped", **({"only_some": True} if i % 4 == 0 else {})} for i in range(8)]
    path = str(tmp_path / "cols.mindrecord")
    with caplog.at_level("WARNING"):
        convert_to_mindrecord(write_jsonl(tmp_path / "cols.jsonl", records), path, tokenizer, template="raw")
    assert sum("['solution'] are not passed to reward functions" in r.getMessage() for r in caplog.records) == 1
    _, _, columns = read_prompt_records(path, with_columns=True)
    assert columns[5] == {"level": 5, "tags": ["t", 1]} and columns[4]["only_some"] is True
    ranks = [PromptDataset(path, batch_size=2, pad_token_id=0, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for _ in range(2):
        for batch in (rank.next_batch() for rank in ranks):
            assert [c["level"] for c in batch["columns"]] == batch["sample_index"].tolist()
    old = str(tmp_path / "old.mindrecord")  # written before the columns field existed
    schema = {k: v for k, v in MINDRECORD_SCHEMA.items() if k != "columns"}
    write_mindrecord_atomically([{"prompt_ids": np.array([1, 2], np.int64), "prompt_length": 2, "solution": "#### 1",
                                  "prompt": "p"}], old, "old prompts", schema=schema)
    assert read_prompt_records(old, with_columns=True)[2] == [{}]


def test_columns_are_passed_per_completion_as_trl_does():
    from mindrlhf.reward import columns_per_completion

    columns = columns_per_completion([{"level": 1, "x": "a"}, {"level": 2}], repeats=3)
    assert columns == {"level": [1, 1, 1, 2, 2, 2], "x": ["a", "a", "a", None, None, None]}
    assert columns_per_completion([{}, {}], repeats=2) == {}


def test_shuffle_is_deterministic_per_seed_and_epoch(tmp_path, tokenizer):
    path = make_mindrecord(tmp_path, tokenizer, 16)
    first = PromptDataset(path, batch_size=4, pad_token_id=0, seed=1)
    again = PromptDataset(path, batch_size=4, pad_token_id=0, seed=1)
    other_seed = PromptDataset(path, batch_size=4, pad_token_id=0, seed=2)
    epoch0 = first.epoch_order(0)
    assert sorted(epoch0.tolist()) == list(range(16))
    assert epoch0.tolist() == again.epoch_order(0).tolist()
    assert epoch0.tolist() != first.epoch_order(1).tolist()
    assert epoch0.tolist() != other_seed.epoch_order(0).tolist()
    assert PromptDataset(path, batch_size=4, pad_token_id=0, shuffle=False).epoch_order(3).tolist() == list(range(16))


def test_without_drop_last_the_tail_is_completed(tmp_path, tokenizer):
    path = make_mindrecord(tmp_path, tokenizer, 10)
    dataset = PromptDataset(path, batch_size=4, pad_token_id=0, drop_last=False)
    batches = list(dataset)
    assert len(batches) == 3 and all(len(b["solution"]) == 4 for b in batches)
    indices = np.concatenate([b["sample_index"] for b in batches]).tolist()
    assert set(indices) == set(range(10)) and indices[10:] == dataset.epoch_order(0)[:2].tolist()
    with pytest.raises(DataError, match="do not fill one global batch of 12"):
        PromptDataset(path, batch_size=6, pad_token_id=0, dp_size=2, dp_rank=1)


def test_resume_continues_with_the_next_batch(tmp_path, tokenizer):
    path = make_mindrecord(tmp_path, tokenizer, 16)
    common = dict(batch_size=2, pad_token_id=0, dp_rank=1, dp_size=2, seed=3, length_buckets=[16, 32])
    original = PromptDataset(path, **common)
    assert len(original) == 4
    for steps in (3, 2):  # the second save lands in the next epoch (3 + 2 = 5 > 4 batches)
        for _ in range(steps):
            original.next_batch()
        state = original.state_dict()
        resumed = PromptDataset(path, **common)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        for _ in range(3):
            expected, got = original.next_batch(), resumed.next_batch()
            assert got["sample_index"].tolist() == expected["sample_index"].tolist()
            assert np.array_equal(got["prompt_ids"], expected["prompt_ids"])
            assert got["solution"] == expected["solution"]
            assert resumed.state_dict() == original.state_dict()
    assert original.state_dict() == {"epoch": 2, "index": 3}
    with pytest.raises(ValueError, match="out of range"):
        resumed.load_state_dict({"epoch": 0, "index": 4})
    with pytest.raises(ValueError, match="data state must be"):
        resumed.load_state_dict({"step": 1})


def test_reader_errors_name_the_file(tmp_path, tokenizer):
    missing = str(tmp_path / "missing.mindrecord")
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(missing)}: MindRecord file not found"):
        PromptDataset(missing, batch_size=1, pad_token_id=0)
    path = make_mindrecord(tmp_path, tokenizer, 4)
    with pytest.raises(ValueError, match="longer than the largest length bucket|more than the largest length bucket"):
        PromptDataset(path, batch_size=1, pad_token_id=0, length_buckets=[1])
    with pytest.raises(ValueError, match="dp_rank must be in"):
        PromptDataset(path, batch_size=1, pad_token_id=0, dp_rank=2, dp_size=2)


# ---------------------------------------------------------------- sample data and CLI

def test_sample_data_is_gsm8k_style_and_reproducible():
    with open(SAMPLE, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 64 and os.path.getsize(SAMPLE) < 100_000
    for line in lines:
        record = json.loads(line)
        match = re.search(r"\n#### (-?\d+)$", record["answer"])
        assert match, record
        notes = re.findall(r"<<([^=>]+)=([^>]+)>>", record["answer"])
        assert notes and all(eval(expr) == float(value) for expr, value in notes)
        assert float(notes[-1][1]) == int(match.group(1))
    spec = importlib.util.spec_from_file_location("make_sample", os.path.join(SAMPLE_DIR, "make_sample.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [json.dumps(p, ensure_ascii=False) for p in module.make_problems(64, 1234)] == lines
    # the held-out split: same generator, another seed, no question of the training sample
    with open(os.path.join(SAMPLE_DIR, "gsm8k_heldout.jsonl"), encoding="utf-8") as f:
        heldout = f.read().splitlines()
    train_questions = frozenset(json.loads(line)["question"] for line in lines)
    assert len(heldout) == 64 and not train_questions & {json.loads(line)["question"] for line in heldout}
    assert [json.dumps(p, ensure_ascii=False) for p in module.make_problems(64, 4321, train_questions)] == heldout


def test_cli_end_to_end_with_the_tiny_tokenizer(tmp_path):
    script = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "rlhf_data.py")
    source = tmp_path / "d.jsonl"
    with open(SAMPLE, encoding="utf-8") as f:
        sample_lines = f.read().splitlines()[:10]
    source.write_text("\n".join(sample_lines[:5] + ["{broken"] + sample_lines[5:]) + "\n", encoding="utf-8")
    output = tmp_path / "out.mindrecord"
    base = [sys.executable, script, "--vocab_path", os.path.join(TINY_DIR, "vocab.json"),
            "--merges_file_path", os.path.join(TINY_DIR, "merges.txt"), "--file_path", str(source),
            "--output_path", str(output), "--template", "r1_think", "--max_prompt_length", "150"]
    failed = run_command(base, timeout=120)
    assert failed.returncode == 2 and failed.stderr.startswith(f"error: {source}:6: invalid JSON"), failed.stderr
    assert "Traceback" not in failed.stderr and not output.exists()
    done = run_command(base + ["--skip_bad_lines"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "written: 10, dropped too long (> 150 tokens): 0, bad lines: 1" in done.stderr
    assert done.stdout == ""
    tokenizer = Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), os.path.join(TINY_DIR, "merges.txt"))
    prompt_ids, solutions = read_prompt_records(str(output))
    questions = [json.loads(line)["question"] for line in sample_lines]
    assert [ids.tolist() for ids in prompt_ids] == [tokenizer.encode(build_prompt(q, "r1_think")) for q in questions]
    assert solutions == [json.loads(line)["answer"] for line in sample_lines]


@pytest.mark.parametrize("case", ["empty dataset", "no gold number", "no tokenizer files", "missing input"])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    script = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "rlhf_data.py")
    source = tmp_path / "d.jsonl"
    source.write_text({"no gold number": json.dumps({"question": "q?", "answer": "many"}) + "\n"}.get(case, ""),
                      encoding="utf-8")
    output = tmp_path / "out.mindrecord"
    output.write_text("previous output", encoding="utf-8")
    tokenizer_dir = str(tmp_path) if case == "no tokenizer files" else TINY_DIR
    input_path = str(tmp_path / "nope.jsonl") if case == "missing input" else str(source)
    expected = {"empty dataset": f"{source}: no prompt left to write",
                "no gold number": f"{source}:1: 'answer' has no gold number",
                "no tokenizer files": f"{tmp_path}: no tokenizer files",
                "missing input": f"{input_path}: input data file not found"}[case]
    proc = run_command([sys.executable, script, "--tokenizer_dir", tokenizer_dir, "--file_path", input_path,
                        "--output_path", output], timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {expected}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert output.read_text(encoding="utf-8") == "previous output"


def test_pad_rows_left_and_right():
    from mindrlhf.data.reader import pad_rows
    ids, mask = pad_rows([[5, 6], [], [7, 8, 9]], 4, pad_token_id=0)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 0], [0, 7, 8, 9]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]]
    ids, mask = pad_rows([[5, 6]], 3, pad_token_id=1, side="right")
    assert ids.tolist() == [[5, 6, 1]] and mask.tolist() == [[1, 1, 0]] and ids.dtype == np.int32
    with pytest.raises(ValueError, match="row 0 has 3 tokens, more than the padded width 2"):
        pad_rows([[1, 2, 3]], 2, 0)


@pytest.mark.parametrize("task,stem,operators", [("word", "arithmetic", {"+", "-", "*"}),
                                                 ("tools", "tool_arithmetic", {"*"})])
def test_arithmetic_task_splits_are_correct_disjoint_and_reproducible(tmp_path, task, stem, operators):
    """The word problems, and the tool task's products of two 3-digit numbers (`--task tools`)."""
    from mindrlhf.data.answers import extract_gold_answer

    spec = importlib.util.spec_from_file_location("make_arithmetic", os.path.join(SAMPLE_DIR, "make_arithmetic.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--output_dir", str(tmp_path), "--task", task])
    splits = {}
    for name in (f"{stem}_train.jsonl", f"{stem}_heldout.jsonl"):
        committed = (Path(SAMPLE_DIR) / name).read_bytes()
        assert (tmp_path / name).read_bytes() == committed, f"{name} is not what make_arithmetic.py writes"
        splits[name] = [json.loads(line) for line in committed.decode().splitlines()]
    train, heldout = splits[f"{stem}_train.jsonl"], splits[f"{stem}_heldout.jsonl"]
    assert len(train) == 2000 and len(heldout) >= 200
    assert not {p["question"] for p in train} & {p["question"] for p in heldout}
    for problem in train + heldout:
        *steps, final = problem["answer"].split("\n")
        value = None
        for step in steps:  # every worked step is right and the last one gives the answer
            expr, result = step.split(" = ")
            assert eval(expr) == int(result) >= 0, problem
            value = int(result)
        assert final == f"#### {value}" and extract_gold_answer(problem["answer"]) == value, problem
    assert {step.split(" ")[1] for p in train for step in p["answer"].split("\n")[:-1]} == operators
    if task == "tools":  # too big to multiply in a small model's head
        assert min(extract_gold_answer(p["answer"]) for p in train) > 10000
