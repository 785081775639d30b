"""Experience of one GRPO step as host arrays: packed for one gather, concatenated across sampling rounds,
split into mini-batches and into each train data-parallel rank's rows."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from mindrlhf.data.reader import pad_rows


@dataclass
class Experience:
    """Rows of responses (sample i of prompt j is row j * G + i); token arrays are [N, P] or [N, R]."""

    prompt_ids: np.ndarray  # int32 [N, P], left-padded
    prompt_mask: np.ndarray  # int32 [N, P]
    response_ids: np.ndarray  # int32 [N, R]
    response_mask: np.ndarray  # int32 [N, R]
    old_logp: np.ndarray  # float32 [N, R]: log-probs under the policy that sampled
    ref_logp: np.ndarray  # float32 [N, R]
    rewards: np.ndarray  # float32 [N]
    advantages: np.ndarray  # float32 [N]
    reward_terms: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [N] per reward function

    @property
    def num_rows(self) -> int:
        return int(self.response_ids.shape[0])

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reward_terms"}
        arrays.update({f"reward_terms/{k}": v for k, v in self.reward_terms.items()})
        return arrays

    def rows(self, index) -> Experience:
        """The rows selected by `index` (a slice, an index array or a boolean mask)."""
        arrays = {k: v[index] for k, v in self._arrays().items()}
        return Experience._from_arrays(arrays)

    @staticmethod
    def _from_arrays(arrays: dict[str, np.ndarray]) -> Experience:
        terms = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("reward_terms/")}
        plain = {k: v for k, v in arrays.items() if not k.startswith("reward_terms/")}
        return Experience(**plain, reward_terms=terms)

    # ------------------------------------------------------------------ packing
    def pack(self) -> np.ndarray:
        """One float32 matrix [N, columns] (token ids are exact in float32 up to 2**24)."""
        columns = [np.asarray(v, np.float32).reshape(self.num_rows, -1) for v in self._arrays().values()]
        return np.concatenate(columns, axis=1)

    def unpack(self, packed: np.ndarray) -> Experience:
        """The inverse of `pack` for rows laid out like this experience's (any number of rows)."""
        out, start = {}, 0
        for name, value in self._arrays().items():
            width = int(np.prod(value.shape[1:], dtype=np.int64)) if value.ndim > 1 else 1
            column = packed[:, start:start + width].reshape((packed.shape[0],) + value.shape[1:])
            out[name] = np.rint(column).astype(value.dtype) if np.issubdtype(value.dtype, np.integer) \
                else column.astype(value.dtype)
            start += width
        return Experience._from_arrays(out)


def concat_experiences(parts: list[Experience], pad_token_id: int) -> Experience:
    """Rows of all parts; prompts are left-padded to the widest part."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.prompt_ids.shape[1] for p in parts)
    arrays = {}
    for name in parts[0]._arrays():
        values = []
        for part in parts:
            value = part._arrays()[name]
            if name in ("prompt_ids", "prompt_mask") and value.shape[1] < width:
                rows = [row[mask.astype(bool)] for row, mask in zip(part.prompt_ids, part.prompt_mask)]
                ids, mask = pad_rows(rows, width, pad_token_id)
                value = ids if name == "prompt_ids" else mask
            values.append(value)
        arrays[name] = np.concatenate(values, axis=0)
    return Experience._from_arrays(arrays)


def update_chunks(num_groups: int, groups_per_update: int, group_size: int) -> list[slice]:
    """Row slices of the optimizer updates of one pass: consecutive runs of `groups_per_update` groups."""
    rows = groups_per_update * group_size
    total = num_groups * group_size
    return [slice(start, min(start + rows, total)) for start in range(0, total, rows)]


def rows_of_rank(num_rows: int, dp_size: int, dp_rank: int) -> slice:
    """This data-parallel rank's contiguous share of `num_rows` rows (which dp_size must divide)."""
    if num_rows % dp_size:
        raise ValueError(f"{num_rows} rows cannot be split evenly over data_parallel={dp_size}")
    per_rank = num_rows // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def group_unit(group_size: int, dp_size: int) -> int:
    """Smallest number of groups whose rows split evenly over `dp_size` ranks."""
    return dp_size // np.gcd(group_size, dp_size)
