"""Experience of one RL step as a table of named host-array columns: packed for one gather, concatenated across
sampling rounds (the engines split it into updates, ranks and graph calls: `mindrlhf.engine.batches`), and written
as a MindRecord (`--save_data_file`).

Rows are responses, in groups of G (sample i of prompt j is row j * G + i; nothing compares rows to find them).
Columns the loop fills, by phase:

    prompt_ids, prompt_mask       int32 [N, P]   left-padded prompts (rollout)
    response_ids, response_mask   int32 [N, R]   (rollout)
    old_logp, ref_logp            float32 [N, R] log-probs of the sampled tokens (rollout, ref, old)
    values                        float32 [N, R] critic values (PPO)
    rewards                       float32 [N]    the sequence reward (reward)
    reward/<function>             float32 [N]    each reward function's unweighted term (reward)
    token_rewards                 float32 [N, R] per-token rewards the estimator reads (reward, KL-in-reward)
    advantages, returns           float32 [N, R] (advantage estimator)
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from mindrlhf.data.mindrecord import write_mindrecord_atomically
from mindrlhf.data.reader import pad_rows

PROMPT_COLUMNS = ("prompt_ids", "prompt_mask")
REWARD_TERM_PREFIX = "reward/"


class Experience:
    """Named columns of equal row count; read as `exp["advantages"]` or `exp.advantages`.

    Not a `Mapping` on purpose: a column may be called `values` or `items`."""

    def __init__(self, columns: Mapping[str, np.ndarray]):
        columns = {name: np.asarray(value) for name, value in columns.items()}
        rows = {value.shape[0] for value in columns.values()}
        if len(rows) > 1:
            sizes = {name: value.shape[0] for name, value in columns.items()}
            raise ValueError(f"experience columns have different row counts: {sizes}")
        self._columns = columns

    # ------------------------------------------------------------------ mapping
    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"experience has no column {name!r}; columns: {list(self._columns)}") from None

    def __getattr__(self, name: str) -> np.ndarray:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._columns[name]
        except KeyError:
            raise AttributeError(f"experience has no column {name!r}; columns: {list(self._columns)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __contains__(self, name: object) -> bool:
        return name in self._columns

    @property
    def num_rows(self) -> int:
        return int(next(iter(self._columns.values())).shape[0]) if self._columns else 0

    @property
    def reward_terms(self) -> dict[str, np.ndarray]:
        """Each reward function's term, by function name."""
        return {name[len(REWARD_TERM_PREFIX):]: value for name, value in self._columns.items()
                if name.startswith(REWARD_TERM_PREFIX)}

    def with_columns(self, **columns: np.ndarray) -> Experience:
        """A copy with `columns` added or replaced."""
        return Experience({**self._columns, **columns})

    def rows(self, index) -> Experience:
        """The rows selected by `index` (a slice, an index array or a boolean mask)."""
        return Experience({name: value[index] for name, value in self._columns.items()})

    # ------------------------------------------------------------------ packing
    def pack(self) -> np.ndarray:
        """One float32 matrix [N, columns] (token ids are exact in float32 up to 2**24)."""
        parts = [np.asarray(v, np.float32).reshape(self.num_rows, -1) for v in self._columns.values()]
        return np.concatenate(parts, axis=1)

    def unpack(self, packed: np.ndarray) -> Experience:
        """The inverse of `pack` for rows laid out like this experience's (any number of rows)."""
        out, start = {}, 0
        for name, value in self._columns.items():
            width = int(np.prod(value.shape[1:], dtype=np.int64)) if value.ndim > 1 else 1
            column = packed[:, start:start + width].reshape((packed.shape[0],) + value.shape[1:])
            out[name] = np.rint(column).astype(value.dtype) if np.issubdtype(value.dtype, np.integer) \
                else column.astype(value.dtype)
            start += width
        return Experience(out)


def trained_tokens(columns) -> str:
    """The column of the response tokens that are the policy's actions (its loss, KL, GAE and the critic's loss
    read them): the model's own (`loss_mask`) in a multi-turn rollout, else every response token."""
    return "loss_mask" if "loss_mask" in columns else "response_mask"


def concat_experiences(parts: list[Experience], pad_token_id: int) -> Experience:
    """Rows of all parts (same columns); prompts are left-padded to the widest part."""
    if len(parts) == 1:
        return parts[0]
    names = list(parts[0])
    for part in parts[1:]:
        if list(part) != names:
            raise ValueError(f"cannot concatenate experiences with columns {names} and {list(part)}")
    width = max(p.prompt_ids.shape[1] for p in parts)
    padded = []
    for part in parts:
        if part.prompt_ids.shape[1] < width:
            rows = [row[mask.astype(bool)] for row, mask in zip(part.prompt_ids, part.prompt_mask)]
            ids, mask = pad_rows(rows, width, pad_token_id)
            part = part.with_columns(prompt_ids=ids.astype(part.prompt_ids.dtype),
                                     prompt_mask=mask.astype(part.prompt_mask.dtype))
        padded.append(part)
    return Experience({name: np.concatenate([p[name] for p in padded], axis=0) for name in names})


EXPERIENCE_SCHEMA = {
    "prompt_ids": {"type": "int32", "shape": [-1]}, "response_ids": {"type": "int32", "shape": [-1]},
    "response_mask": {"type": "int32", "shape": [-1]}, "loss_mask": {"type": "int32", "shape": [-1]},
    "ref_logp": {"type": "float32", "shape": [-1]},
    "old_logp": {"type": "float32", "shape": [-1]}, "reward": {"type": "float32"},
    "advantages": {"type": "float32", "shape": [-1]}, "returns": {"type": "float32", "shape": [-1]},
}


def write_experience(path: str, exp: Experience) -> None:
    """One step's experience as MindRecord (real prompt tokens only; responses padded to the step's width; no
    `ref_logp` in a job without a reference model; `loss_mask`, the model's own tokens, in a job with tools)."""
    optional = ("loss_mask", "ref_logp")
    per_token = [name for name in ("ref_logp", "old_logp", "advantages", "returns") if name in exp]
    records = []
    for i in range(exp.num_rows):
        record = {"prompt_ids": exp.prompt_ids[i][exp.prompt_mask[i].astype(bool)].astype(np.int32),
                  "reward": float(exp.rewards[i])}
        for name in ("response_ids", "response_mask", "loss_mask"):
            if name in exp:
                record[name] = exp[name][i].astype(np.int32)
        for name in per_token:
            record[name] = exp[name][i].astype(np.float32)
        records.append(record)
    schema = {name: field for name, field in EXPERIENCE_SCHEMA.items() if name not in optional or name in exp}
    write_mindrecord_atomically(records, path, "mindrlhf experience", schema=schema)
