"""SFT and preference records: the formats read as messages, the assistant-token mask, packing, and the
MindRecord conversion with its one-line errors."""
import json

import numpy as np
import pytest
from support.paths import ARITH

from mindrlhf.data.conversations import (
    conversation_segments,
    pack_rows,
    packing_positions,
    pair_messages,
    record_kind,
    sft_messages,
    tokenize_segments,
)
from mindrlhf.data.sources import DataError
from mindrlhf.models.tokenizer import load_tokenizer

W = "data.jsonl:3"
QA = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ARITH / "policy")


def test_alpaca_sharegpt_and_messages_read_as_the_same_conversation():
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "Be brief.",
              "history": [["Hi", "Hello!"]]}
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Add the numbers.\n2 and 3"},
                {"role": "assistant", "content": "5"}]
    assert sft_messages(alpaca, W) == expected
    sharegpt = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                   "value": m["content"]} for m in expected]}
    assert sft_messages(sharegpt, W) == expected
    assert sft_messages({"messages": expected}, W) == expected
    assert [record_kind(r) for r in (alpaca, sharegpt, {"messages": expected}, {"question": "q", "answer": "1"},
                                     {"prompt": "q", "chosen": "a", "rejected": "b"})] == \
        ["sft", "sft", "sft", "prompts", "pairwise"]


@pytest.mark.parametrize("record,message", [
    ({"instruction": "x"}, "data.jsonl:3: an Alpaca record needs 'output'"),
    ({"instruction": 3, "output": "y"}, "data.jsonl:3: field 'instruction' must be a string, got int"),
    ({"messages": [{"role": "user", "content": "q"}]}, "data.jsonl:3: the conversation has no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "data.jsonl:3: the first assistant turn (message 0) has "
                                                              "no user turn before it"),
    ({"messages": [{"role": "bot", "content": "a"}]}, "data.jsonl:3: messages[0].role is 'bot', expected one of"),
    ({"conversations": [{"from": "human"}]}, "data.jsonl:3: conversations[0] must be an object with 'from' and"),
    ({"text": "hello"}, "data.jsonl:3: not an SFT record: expected 'messages', 'conversations' or 'instruction'"),
])
def test_a_malformed_sft_record_is_refused_naming_its_line_and_field(record, message):
    with pytest.raises(DataError) as err:
        sft_messages(record, W)
    assert str(err.value).startswith(message)


def test_pairs_in_trl_and_alpaca_forms_share_their_prompt():
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    trl = pair_messages({"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}, W)
    assert trl.prompt == prompt and trl.chosen == [{"role": "assistant", "content": "5"}]
    messages = pair_messages({"prompt": prompt, "chosen": [{"role": "assistant", "content": "5"}],
                              "rejected": [{"role": "assistant", "content": "6"}]}, W)
    assert messages == trl
    implicit = pair_messages({"chosen": prompt + [{"role": "assistant", "content": "5"}],
                              "rejected": prompt + [{"role": "assistant", "content": "6"}]}, W)
    assert implicit == trl
    alpaca = pair_messages({"question": "What is 2+3?", "chosen": "5", "rejected": "6"}, W)
    assert alpaca == trl
    with pytest.raises(DataError, match="^data.jsonl:3: a pairwise record needs 'chosen' and 'rejected'; 'rejected'"):
        pair_messages({"prompt": "q", "chosen": "a"}, W)
    with pytest.raises(DataError, match="^data.jsonl:3: 'chosen' must start with the assistant's answer"):
        pair_messages({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, W)


def test_only_every_assistant_turn_and_its_end_token_are_trained(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, *QA, {"role": "user", "content": "And 4+4?"},
                    {"role": "assistant", "content": "8"}]
    pieces = conversation_segments(conversation, tokenizer.apply_chat_template)
    assert "".join(text for text, _ in pieces) == tokenizer.apply_chat_template(conversation,
                                                                                add_generation_prompt=False)
    assert [text for text, trained in pieces if trained] == ["5<|im_end|>", "8<|im_end|>"]
    ids, mask = tokenize_segments(pieces, tokenizer.encode)
    # the pieces tokenised one by one are the whole text's tokens (their edges are the template's special tokens)
    whole = tokenizer.encode(tokenizer.apply_chat_template(conversation, add_generation_prompt=False))
    np.testing.assert_array_equal(ids, whole)
    runs = np.split(ids, np.flatnonzero(np.diff(mask)) + 1)
    trained = [tokenizer.decode(run.tolist()) for run, m in zip(runs, np.split(mask, np.flatnonzero(np.diff(mask)) + 1))
               if m[0]]
    assert trained == ["5<|im_end|>", "8<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    def forgetful(messages, add_generation_prompt=True):  # drops all but the last turn, as reasoning templates do
        return "".join(f"<{m['role']}>{m['content']}" for m in messages[-1:]) + ("<assistant>" if
                                                                                add_generation_prompt else "")

    with pytest.raises(ValueError, match="does not render message 1 as an extension of the messages before it"):
        conversation_segments([*QA, {"role": "user", "content": "again"}, {"role": "assistant", "content": "6"}],
                              forgetful)


def test_packing_fills_rows_best_fit_and_restarts_positions_per_sample():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]  # 2+6, 5+3, 4: each row in input order
    assert sum(len(r) for r in pack_rows([1] * 9, 4)) == 9
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, more than a packed row's 8"):
        pack_rows([2, 9], 8)
    positions, segments = packing_positions([3, 2])
    assert positions.tolist() == [0, 1, 2, 0, 1] and segments.tolist() == [1, 1, 1, 2, 2]


def test_sft_and_pairwise_files_become_mindrecords_and_bad_lines_name_their_place(tokenizer, tmp_path):
    from mindspore.mindrecord import FileReader

    from mindrlhf.data.stage_records import convert_stage_data

    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(r) for r in [
        {"instruction": "What is 2+3?", "output": "5"}, {"messages": QA},
        {"conversations": [{"from": "human", "value": "What is 2+3?"}, {"from": "gpt", "value": "5"}]}]) + "\n")
    stats = convert_stage_data(sft, tmp_path / "sft.mindrecord", tokenizer)
    assert (stats.kind, stats.written) == ("sft", 3)
    rows = list(FileReader(str(tmp_path / "sft.mindrecord")).get_next())
    assert len({tuple(r["input_ids"]) for r in rows}) == 1  # three formats, one conversation
    assert tokenizer.decode(rows[0]["input_ids"][rows[0]["loss_mask"] == 1].tolist()) == "5<|im_end|>"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "What is 2+3?", "chosen": "5", "rejected": "It is 6"}) + "\n")
    stats = convert_stage_data(pairs, tmp_path / "pairs.mindrecord", tokenizer)
    (row,) = list(FileReader(str(tmp_path / "pairs.mindrecord")).get_next())
    assert stats.kind == "pairwise"
    assert tokenizer.decode(row["prompt_ids"].tolist()) == tokenizer.apply_chat_template(QA[:1])
    assert [tokenizer.decode(row[k].tolist()) for k in ("chosen_ids", "rejected_ids")] == \
        ["5<|im_end|>", "It is 6<|im_end|>"]
    sft.write_text(sft.read_text() + '{"instruction": "x"}\n')
    with pytest.raises(DataError, match=f"^{sft}:4: an Alpaca record needs 'output'"):
        convert_stage_data(sft, tmp_path / "bad.mindrecord", tokenizer, kind="sft")
    assert convert_stage_data(sft, tmp_path / "ok.mindrecord", tokenizer, skip_bad_lines=True).bad_lines == 1
    with pytest.raises(DataError, match=r"no record left to write \(sft: written 0, dropped too long 3, bad lines 1"):
        convert_stage_data(sft, tmp_path / "short.mindrecord", tokenizer, max_length=10, skip_bad_lines=True)


def test_a_packed_sft_dataset_holds_each_conversation_once_with_its_positions_mask_and_padding_share(tokenizer,
                                                                                                     tmp_path):
    """Conversations of other lengths packed into rows of 136 tokens: each appears whole in exactly one row, its
    positions restarting at 0 and its own segment id, its loss mask its unpacked one; the reported padding shares
    are those of the rows; a conversation longer than a row is refused with its record."""
    from mindrlhf.data.stage_data import PackedSFTDataset, SFTDataset
    from mindrlhf.data.stage_records import convert_stage_data

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"What is {n}+{n}?", "output": " ".join(["yes"] * n)}) + "\n"
                            for n in (1, 9, 3, 14, 2, 6, 4)))
    convert_stage_data(path, tmp_path / "sft.mindrecord", tokenizer)
    plain = SFTDataset(tmp_path / "sft.mindrecord", tokenizer.pad_token_id)
    packed = PackedSFTDataset(tmp_path / "sft.mindrecord", tokenizer.pad_token_id, max_length=136)
    conversations = {tuple(np.concatenate([p, r])): np.concatenate([np.zeros(len(p), np.int32), m])
                     for p, r, m in plain.train}
    rows = packed.split_rows("train")
    assert packed.response_width == 136 and rows.response_ids.shape == (len(packed.train), 136)
    assert len(packed.train) < len(conversations) and "prompt_ids" not in rows
    seen = []
    for i in range(rows.num_rows):
        segments = rows.segment_ids[i]
        assert (rows.response_mask[i] == (segments > 0)).all()
        for k in range(1, segments.max() + 1):
            at = segments == k
            ids = tuple(rows.response_ids[i][at])
            assert rows.position_ids[i][at].tolist() == list(range(len(ids)))
            np.testing.assert_array_equal(rows.loss_mask[i][at], conversations[ids])
            seen.append(ids)
        assert not rows.loss_mask[i][segments == 0].any()
    assert sorted(seen) == sorted(conversations)
    tokens = sum(len(ids) for ids in seen)
    unpacked = plain.split_rows("train")
    unpacked_positions = unpacked.prompt_mask.size + unpacked.response_mask.size
    assert packed.padding_shares() == pytest.approx((1 - tokens / (rows.num_rows * 136),
                                                     1 - tokens / unpacked_positions))
    with pytest.raises(DataError, match=r"sft.mindrecord: record 3: \d+ tokens, more than sft.max_length=96"):
        PackedSFTDataset(tmp_path / "sft.mindrecord", tokenizer.pad_token_id, max_length=96)


def test_the_held_out_split_keeps_a_prompts_pairs_together_and_is_the_plain_draw_without_groups(tokenizer, tmp_path):
    """held_out_records: ungrouped it is the seeded permutation's first records (the split before groups existed);
    grouped, whole groups until the fraction is reached. A pair file of 4 pairs a prompt holds out whole prompts."""
    from mindrlhf.data.stage_data import PairDataset, held_out_records
    from mindrlhf.data.stage_records import convert_stage_data

    plain = held_out_records([None] * 40, 0.1, seed=3)
    assert sorted(plain) == sorted(np.random.default_rng(3).permutation(40)[:4].tolist())
    assert held_out_records([None] * 40, 0.0, seed=3) == [] and len(held_out_records([None] * 3, 0.01, 0)) == 1
    keys = [k // 4 for k in range(40)]  # 10 groups of 4
    grouped = held_out_records(keys, 0.15, seed=3)
    assert len(grouped) == 8 and all(keys.count(keys[i]) == sum(keys[j] == keys[i] for j in grouped)
                                     for i in grouped)  # two whole groups
    pairs = tmp_path / "pairs.jsonl"
    records = [{"prompt": f"What is {p}+{p}?", "chosen": str(2 * p), "rejected": str(w)}
               for p in range(10) for w in range(4)]
    pairs.write_text("".join(json.dumps(record) + "\n" for record in records))
    convert_stage_data(pairs, tmp_path / "pairs.mindrecord", tokenizer)
    data = PairDataset(tmp_path / "pairs.mindrecord", tokenizer.pad_token_id, seed=1, eval_fraction=0.2)
    held, train = ({r[0].tobytes() for r in split} for split in (data.held_out, data.train))
    assert (len(data.held_out), len(data.train), len(held)) == (8, 32, 2) and not held & train
