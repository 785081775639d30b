"""Tensor-parallel layers (Megatron style, explicit SPMD): each rank holds its shard and communicates.

With `layout.tp == 1` they are plain layers with no collective. Every layer records which tensor
dimension of each of its parameters is split over tp in `split_axes` (`None` = replicated); the
network-wide view is :func:`param_split_axes`, from which strategy files are written.
"""
from __future__ import annotations

import zlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, Zero, initializer

from mindrlhf.configs.lora import is_adapter
from mindrlhf.parallel.comm import (
    CopyToTensorParallel,
    GatherFromTensorParallel,
    MaxOverGroup,
    ReduceFromTensorParallel,
    SplitToTensorParallel,
)
from mindrlhf.parallel.layout import Layout, LayoutError

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
INIT_STD = 0.02  # weights are normally loaded from a checkpoint; this only makes fresh nets usable


def to_ms_dtype(name: str):
    """MindSpore dtype for a config dtype name."""
    return DTYPES[name]


def shard_size(full: int, parts: int, what: str) -> int:
    """`full // parts`, with an error naming `what` when it does not divide."""
    if full % parts:
        raise LayoutError(f"{what}={full} is not divisible by the tensor-parallel size {parts}")
    return full // parts


class ParallelLayer(nn.Cell):
    """Base of the layers below: the layout, the split axes and the tp collectives to use."""

    def __init__(self, layout: Layout | None):
        super().__init__()
        self.layout = layout or Layout()
        self.tp_size = self.layout.tp
        self.tp_rank = self.layout.tp_rank
        self.split_axes: dict[str, int | None] = {}
        self.split_shards: dict[str, int] = {}  # parameters cut into fewer shards than tp (shared by tp peers)


class _LowRankAdapted(ParallelLayer):
    """A linear layer that may carry a LoRA adapter (Hu et al. 2021, PEFT's form): y = W x + b + (alpha / r) B A
    dropout(x), A [r, in], B [out, r], named `<layer>.lora_a` / `<layer>.lora_b`. Where a rank's
    gradient of A or B is a partial sum, it is summed over the ranks that hold the same part (`_lora_grad_groups`),
    as for the weight; the forward needs no collective of its own."""

    def __init__(self, layout: Layout | None):
        super().__init__(layout)
        self.has_lora = False  # `lora_a`, `lora_b` exist once `add_lora` made them

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """Adds the adapter of `rank`, scaled alpha / rank (A and B zero here; `lora_full_state` is PEFT's start)."""
        a_shape, b_shape = self._lora_shapes(rank)
        dtype = self.weight.dtype
        self.lora_a = Parameter(initializer(Zero(), a_shape, dtype), name="lora_a")  # named by the cell's path
        self.lora_b = Parameter(initializer(Zero(), b_shape, dtype), name="lora_b")
        self.lora_scaling = float(alpha) / rank
        self.has_lora = True
        self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else None
        self._sum_grad_a, self._sum_grad_b = (CopyToTensorParallel(group) if group else None
                                              for group in self._lora_grad_groups())

    def _lora(self, x2d):
        """(alpha / r) B A dropout(x) for the flattened input [N, in(_local)]."""
        a, b = self.lora_a.astype(self.compute_dtype), self.lora_b.astype(self.compute_dtype)
        if self._sum_grad_a is not None:
            a = self._sum_grad_a(a)
        if self._sum_grad_b is not None:
            b = self._sum_grad_b(b)
        if self.lora_dropout is not None:
            x2d = self.lora_dropout(x2d)
        # scaled at rank width, not at the output's: the same product, a r-wide multiply instead of an out-wide one
        return self.matmul(self.matmul(x2d, a) * self.lora_scaling, b)


class ColumnParallelLinear(_LowRankAdapted):
    """y = x W^T + b with W [out, in] split by rows (output features) over tp.

    The input is replicated; the output stays split unless `gather_output`. With `shards` < tp the rows are cut
    into `shards` parts only, each held by tp / shards consecutive tp ranks (key/value projections when tp
    exceeds the kv heads, as Megatron and vLLM replicate them); the gradient of a shared part is summed over
    the ranks that share it.
    """

    def __init__(self, in_features: int, out_features: int, has_bias: bool = False, layout: Layout | None = None,
                 gather_output: bool = False, param_dtype=ms.float32, compute_dtype=ms.float32, name: str = "linear",
                 shards: int | None = None):
        super().__init__(layout)
        shards = shards or self.tp_size
        if self.tp_size % shards or (gather_output and shards != self.tp_size):
            raise LayoutError(f"{name}: {shards} shards do not divide the tensor-parallel size {self.tp_size}")
        self.out_local = shard_size(out_features, shards, f"{name} output features")
        self.weight = Parameter(initializer(Normal(INIT_STD), (self.out_local, in_features), param_dtype),
                                name="weight")
        self.has_bias = has_bias
        self.bias = Parameter(initializer(Zero(), (self.out_local,), param_dtype), name="bias") if has_bias else None
        self.split_axes = {"weight": 0, "bias": 0} if has_bias else {"weight": 0}
        self.share = None
        if shards < self.tp_size:
            self.split_shards = {attr: shards for attr in self.split_axes}
            self.share = CopyToTensorParallel(self.layout.shard_group(shards))  # identity; gradient summed
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.copy_in = CopyToTensorParallel(self.layout.tp_group) if self.tp_size > 1 else None
        self.gather_out = (GatherFromTensorParallel(self.layout.tp_group, self.tp_size, self.tp_rank)
                           if self.tp_size > 1 and gather_output else None)

    def construct(self, x):
        if self.copy_in is not None:
            x = self.copy_in(x)
        lead = x.shape[:-1]
        weight, bias = self.weight, self.bias
        if self.share is not None:  # through a cast, not as the Parameter itself: see RMSNorm.construct
            weight = self.share(weight.astype(weight.dtype))
            if self.has_bias:
                bias = self.share(bias.astype(bias.dtype))
        x2d = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        y = self.matmul(x2d, weight.astype(self.compute_dtype))
        if self.has_bias:
            y = ops.bias_add(y, bias.astype(self.compute_dtype))
        if self.has_lora:
            y = y + self._lora(x2d)
        y = y.reshape(lead + (self.out_local,))
        if self.gather_out is not None:
            y = self.gather_out(y)
        return y

    def _lora_shapes(self, rank: int):
        return (rank, self.weight.shape[1]), (self.out_local, rank)

    def _lora_grad_groups(self):
        # A is whole and sees the gradient of this rank's outputs only; B is split like the weight, a part that tp
        # peers share (`shards` < tp) summed over them
        shared = self.layout.shard_group(self.split_shards["weight"]) if self.share is not None else None
        return self.layout.tp_group, shared

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().add_lora(rank, alpha, dropout)
        self.split_axes.update({"lora_a": None, "lora_b": 0})
        if self.share is not None:
            self.split_shards["lora_b"] = self.split_shards["weight"]


class RowParallelLinear(_LowRankAdapted):
    """y = x W^T + b with W [out, in] split by columns (input features) over tp.

    The input arrives split (from a column-parallel layer); partial products are summed over tp.
    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, has_bias: bool = False, layout: Layout | None = None,
                 param_dtype=ms.float32, compute_dtype=ms.float32, name: str = "linear"):
        super().__init__(layout)
        self.in_local = shard_size(in_features, self.tp_size, f"{name} input features")
        self.out_features = out_features
        self.weight = Parameter(initializer(Normal(INIT_STD), (out_features, self.in_local), param_dtype),
                                name="weight")
        self.has_bias = has_bias
        self.bias = Parameter(initializer(Zero(), (out_features,), param_dtype), name="bias") if has_bias else None
        self.split_axes = {"weight": 1, "bias": None} if has_bias else {"weight": 1}
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.reduce_out = ReduceFromTensorParallel(self.layout.tp_group) if self.tp_size > 1 else None

    def construct(self, x):
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        y = self.matmul(x2d, self.weight.astype(self.compute_dtype))
        if self.has_lora:  # a partial sum, as the weight's: reduced with it
            y = y + self._lora(x2d)
        y = y.reshape(lead + (self.out_features,))
        if self.reduce_out is not None:
            y = self.reduce_out(y)
        if self.has_bias:
            y = ops.bias_add(y.reshape(-1, self.out_features), self.bias.astype(self.compute_dtype)).reshape(y.shape)
        return y

    def _lora_shapes(self, rank: int):
        return (rank, self.in_local), (self.out_features, rank)

    def _lora_grad_groups(self):
        # A is split like the weight (its gradient is this rank's own); B is whole and sees this rank's part of x
        return None, self.layout.tp_group

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().add_lora(rank, alpha, dropout)
        self.split_axes.update({"lora_a": 1, "lora_b": None})


class VocabParallelEmbedding(ParallelLayer):
    """Token embedding with the vocabulary split over tp; out-of-shard ids contribute zeros, summed over tp."""

    def __init__(self, vocab_size: int, hidden_size: int, layout: Layout | None = None, param_dtype=ms.float32,
                 compute_dtype=ms.float32):
        super().__init__(layout)
        self.vocab_local = shard_size(vocab_size, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.vocab_local
        self.embedding_weight = Parameter(
            initializer(Normal(INIT_STD), (self.vocab_local, hidden_size), param_dtype), name="embedding_weight")
        self.split_axes = {"embedding_weight": 0}
        self.compute_dtype = compute_dtype
        self.reduce_out = ReduceFromTensorParallel(self.layout.tp_group) if self.tp_size > 1 else None

    def construct(self, input_ids):
        weight = self.embedding_weight.astype(self.compute_dtype)
        if self.reduce_out is None:
            return ops.gather(weight, input_ids, 0)
        local_ids = input_ids - self.vocab_start
        in_shard = ops.logical_and(local_ids >= 0, local_ids < self.vocab_local)
        local_ids = ops.where(in_shard, local_ids, ops.zeros_like(local_ids))
        out = ops.gather(weight, local_ids, 0) * ops.expand_dims(in_shard, -1).astype(self.compute_dtype)
        return self.reduce_out(out)


class VocabParallelLogProbs(ParallelLayer):
    """log softmax(logits)[label] in float32 from vocab-split logits, without gathering the vocabulary.

    Without tp: one LogSoftmax. With tp, per shard: the stabilising max is gathered without gradient, the
    partition function and the label's logit are AllReduce(SUM)-ed with identity backward. With
    `with_entropy` it also returns the entropy of softmax(logits) per position (no gradient).
    """

    def __init__(self, vocab_size: int, layout: Layout | None = None):
        super().__init__(layout)
        self.vocab_local = shard_size(vocab_size, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.vocab_local
        if self.tp_size > 1:
            group = self.layout.tp_group
            self.max_over_tp = MaxOverGroup(group, self.tp_size, self.tp_rank)
            self.sum_exp_over_tp = ReduceFromTensorParallel(group)
            self.label_logit_over_tp = ReduceFromTensorParallel(group)
            self.entropy_over_tp = ReduceFromTensorParallel(group)
        else:
            self.max_over_tp = None

    def _entropy(self, shifted, sum_exp):
        """log Z - sum_v p_v * shifted_v, with the sum over the vocabulary reduced over tp."""
        shifted = ops.stop_gradient(shifted)
        sum_exp = ops.stop_gradient(sum_exp)
        weighted = self.entropy_over_tp((ops.exp(shifted) * shifted).sum(-1))
        return ops.log(sum_exp) - weighted / sum_exp

    def construct(self, logits, labels, with_entropy=False):
        logits = logits.astype(ms.float32)
        if self.max_over_tp is None:
            # one fused LogSoftmax kernel (and its grad): faster and ~3 fewer [tokens, vocab] buffers than the
            # max / subtract / exp / sum chain the tp path needs (`docs/performance.md`, "Where the tiny train
            # step goes")
            log_softmax = ops.log_softmax(logits, -1)
            logp = ops.gather_elements(log_softmax, -1, ops.expand_dims(labels, -1)).squeeze(-1)
            if with_entropy:
                log_softmax = ops.stop_gradient(log_softmax)
                return logp, -(ops.exp(log_softmax) * log_softmax).sum(-1)
            return logp
        local_max = ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True)[0])
        global_max = self.max_over_tp(local_max)
        shifted = logits - global_max
        sum_exp = self.sum_exp_over_tp(ops.exp(shifted).sum(-1))
        local_labels = labels - self.vocab_start
        in_shard = ops.logical_and(local_labels >= 0, local_labels < self.vocab_local)
        local_labels = ops.where(in_shard, local_labels, ops.zeros_like(local_labels))
        label_logit = ops.gather_elements(shifted, -1, ops.expand_dims(local_labels, -1)).squeeze(-1)
        label_logit = self.label_logit_over_tp(label_logit * in_shard.astype(ms.float32))
        logp = label_logit - ops.log(sum_exp)
        if with_entropy:
            return logp, self._entropy(shifted, sum_exp)
        return logp


# below this many elements an implicit broadcast is cheaper than one more kernel (decode steps stay as they were)
EXPAND_MIN_ELEMENTS = 1 << 16


@ops.constexpr
def _is_large(shape) -> bool:
    count = 1
    for dim in shape:
        count *= dim
    return count >= EXPAND_MIN_ELEMENTS


def expand_as(small, like):
    """`small` broadcast to `like`'s shape when `like` is large, so that the element-wise op that follows sees
    equal shapes (same values either way).

    On MindSpore's CPU backend a binary op that broadcasts one input keeps several output-sized buffers alive
    until its graph is released, far more than with an explicit broadcast or equal shapes; through a
    transformer's norms, rotary and attention bias that was most of a forward graph's memory
    (`docs/performance.md`, "Broadcasting and memory on CPU")."""
    if _is_large(like.shape):
        return ops.broadcast_to(small, like.shape)
    return small


def scaled_by_temperature(logits, temperature: float):
    """`logits` / `temperature`, computed as a product with 1 / `temperature` (at most an ulp apart).

    On MindSpore's CPU backend a division by a scalar keeps index tables of 16 bytes an element of its output while
    its graph lives, a multiplication by one keeps none: at SmolLM2's 16 x 96 responses and 49152 tokens the
    reference pass kept 1.15 GiB more with the division, a 2-response train call 0.29 GiB (`docs/performance.md`,
    "A division by the temperature kept 1.4 GiB")."""
    return logits if temperature == 1.0 else logits * (1.0 / temperature)


class RMSNorm(nn.Cell):
    """RMSNorm computed in float32, scaled by a replicated weight (as Hugging Face Qwen2RMSNorm).

    With `sequence_parallel` (a layout with tp > 1) each rank normalises its part of the sequence, so its weight
    gradient is partial: it is summed over the tp group."""

    def __init__(self, hidden_size: int, eps: float, param_dtype=ms.float32, compute_dtype=ms.float32,
                 sequence_parallel: Layout | None = None):
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden_size,), param_dtype), name="weight")
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.sum_weight_grad = CopyToTensorParallel(sequence_parallel.tp_group) \
            if sequence_parallel is not None and sequence_parallel.tp > 1 else None

    def construct(self, x):
        x32 = x.astype(ms.float32)
        variance = ops.mean(ops.square(x32), -1, keep_dims=True)
        normed = (x32 * expand_as(ops.rsqrt(variance + self.eps), x32)).astype(self.compute_dtype)
        weight = self.weight
        if self.sum_weight_grad is not None:
            # the weight enters the custom-bprop cell through a cast to its own dtype (its gradient summed in that
            # dtype): passed as the Parameter itself inside an inlined decoder layer (`lazy_inline`) it gave wrong
            # values from the first forward on (docs/performance.md)
            weight = self.sum_weight_grad(weight.astype(weight.dtype))
        return expand_as(weight.astype(self.compute_dtype), normed) * normed


class SequenceParallel(ParallelLayer):
    """Megatron's sequence parallel over the tp group: between the tensor-parallel blocks the residual stream
    [B, L, D] is cut along the sequence, each rank keeping [B, L / tp, D] (zero-padded to a multiple of tp), so the
    norms, residual adds and what they keep for the backward are 1/tp per rank. `gather` before the column-parallel
    layers (backward: this rank's part of the whole gradient), `split` after the row-parallel ones (after their
    AllReduce: together a reduce-scatter; backward gathers the parts' gradients). On CPU both gathers are
    AllReduces of zero-padded parts (`mindrlhf.parallel.comm`)."""

    def __init__(self, layout: Layout):
        super().__init__(layout)
        group = self.layout.tp_group
        self.split_parts = SplitToTensorParallel(group, self.tp_size, self.tp_rank, axis=1)
        self.gather_parts = GatherFromTensorParallel(group, self.tp_size, self.tp_rank, axis=1)

    def split(self, x):
        """Replicated [B, L, D] -> this rank's part [B, ceil(L / tp), D] (zeros past L)."""
        padding = -x.shape[1] % self.tp_size
        if padding:  # a concat, not ops.pad: on CPU the gradient of a pad was wrong from a graph's second run on
            x = ops.concat((x, ops.zeros((x.shape[0], padding, x.shape[2]), x.dtype)), 1)
        return self.split_parts(x)

    def gather(self, x, length: int):
        """The parts -> replicated [B, length, D] (the padding cut off)."""
        full = self.gather_parts(x)
        if full.shape[1] > length:
            return full[:, :length]
        return full


def param_split_axes(net: nn.Cell) -> dict[str, int | None]:
    """Full parameter name -> tensor dimension split over tensor parallel (None = replicated)."""
    split_by_name: dict[str, int | None] = {}
    for _, cell in net.cells_and_names():
        for attr, axis in (getattr(cell, "split_axes", None) or {}).items():
            param = getattr(cell, attr, None)
            if isinstance(param, Parameter):
                split_by_name[param.name] = axis
    return {param.name: split_by_name.get(param.name) for param in net.get_parameters()}


def param_split_shards(net: nn.Cell, tp: int) -> dict[str, int]:
    """Full parameter name -> into how many shards its split axis is cut over tensor parallel: `tp`, or fewer
    for a parameter that tp peers share (`ColumnParallelLinear(shards=...)`); 1 for replicated ones."""
    shards_by_name: dict[str, int] = {}
    for _, cell in net.cells_and_names():
        for attr, shards in (getattr(cell, "split_shards", None) or {}).items():
            param = getattr(cell, attr, None)
            if isinstance(param, Parameter):
                shards_by_name[param.name] = shards
    axes = param_split_axes(net)
    return {name: 1 if axis is None else shards_by_name.get(name, tp) for name, axis in axes.items()}


def full_shape(local_shape: tuple[int, ...], split_axis: int | None, shards: int) -> tuple[int, ...]:
    """Shape of the unsplit tensor from a shard's shape (`shards` along `split_axis`)."""
    shape = list(local_shape)
    if split_axis is not None:
        shape[split_axis] *= shards
    return tuple(shape)


def shard_array(full: np.ndarray, split_axis: int | None, shards: int, index: int) -> np.ndarray:
    """Shard `index` of a full array cut into `shards` along `split_axis`."""
    if split_axis is None or shards == 1:
        return full
    return np.split(full, shards, axis=split_axis)[index]


def load_full_state(net: nn.Cell, state: dict[str, np.ndarray], layout: Layout | None = None,
                    strict: bool = True) -> list[str]:
    """Loads unsplit arrays into a (possibly tp-split) net, slicing each to this rank's shard.

    Returns the names of net parameters absent from `state` (an error when `strict`).
    """
    layout = layout or Layout()
    axes, shards = param_split_axes(net), param_split_shards(net, layout.tp)
    missing = []
    for param in net.get_parameters():
        if param.name not in state:
            missing.append(param.name)
            continue
        parts = shards[param.name]
        shard = shard_array(np.asarray(state[param.name]), axes[param.name], parts, layout.shard_of(parts))
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"parameter {param.name}: shard shape {shard.shape} (layout {layout}) does not match "
                             f"the network's {tuple(param.shape)}")
        param.set_data(Tensor(shard, param.dtype))
    if strict and missing:
        raise ValueError(f"parameters missing from the state: {', '.join(missing)}")
    return missing


def random_full_state(net: nn.Cell, layout: Layout | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random unsplit weights for every parameter of `net`, the same whatever the layout.

    Each parameter draws from its own stream (seed, name), so the values do not depend on the order
    or the set of parameters. Norm weights ~ 1 + 0.1 N(0, 1), biases ~ 0.1 N(0, 1), matrices
    ~ N(0, 1) / sqrt(fan_in): logits then have a spread of a few nats, as in a trained model.
    """
    layout = layout or Layout()
    axes, shards = param_split_axes(net), param_split_shards(net, layout.tp)
    state = {}
    for param in net.get_parameters():
        shape = full_shape(tuple(param.shape), axes[param.name], shards[param.name])
        rng = np.random.default_rng([seed, zlib.crc32(param.name.encode())])
        values = rng.standard_normal(shape)
        if param.name.endswith("norm.weight") or param.name.endswith("norm_out.weight"):
            values = 1.0 + 0.1 * values
        elif len(shape) == 1:
            values = 0.1 * values
        else:
            values = values / np.sqrt(shape[-1])
        state[param.name] = values.astype(np.float32)
    return state


def lora_full_state(net: nn.Cell, layout: Layout | None = None, seed: int = 0,
                    prefix: str = "") -> dict[str, np.ndarray]:
    """PEFT's start of every adapter of `net`, unsplit and the same whatever the layout: A ~ U(-1/sqrt(in),
    1/sqrt(in)) (torch's kaiming_uniform_ with a = sqrt(5)), each from its own stream (seed, its name without the
    net's `prefix`: a train net and its inference twin start alike); B = 0."""
    layout = layout or Layout()
    axes, shards = param_split_axes(net), param_split_shards(net, layout.tp)
    state = {}
    for param in net.get_parameters():
        if not is_adapter(param.name):
            continue
        shape = full_shape(tuple(param.shape), axes[param.name], shards[param.name])
        if param.name.endswith(".lora_b"):
            state[param.name] = np.zeros(shape, np.float32)
            continue
        bound = 1.0 / np.sqrt(shape[1])
        plain = param.name[len(prefix):] if param.name.startswith(prefix) else param.name
        rng = np.random.default_rng([seed, zlib.crc32(plain.encode())])
        state[param.name] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return state


def init_random_weights(net: nn.Cell, layout: Layout | None = None, seed: int = 0) -> None:
    """Fills `net` (this rank's shards) with :func:`random_full_state`: consistent across ranks and layouts."""
    load_full_state(net, random_full_state(net, layout, seed), layout)
