"""Ulysses sequence parallelism's and --tiled-mlp's DeepSpeed internals: the sequence-parallel unit (mpu), the
all-to-all around attention, TiledMLP, and the gradient factor of ZeRO-3's averaging. The sequence-parallel room
is launcher/sequence/; this is its DeepSpeed part."""
from __future__ import annotations

import functools

from zerotrain.launcher.components.ds_compat.names import PrivateName

# the DeepSpeed names this part relies on (ds_compat.PRIVATE_NAMES gathers them; check_deepspeed_version)
NAMES = (
    PrivateName("deepspeed.sequence.layer", "_dim_zero_all_to_all",
                "--sequence-parallel: the Ulysses all-to-all around attention", True,
                source_has="_dim_zero_all_to_all_op(input.contiguous(), group.group_name)"),
    PrivateName("deepspeed.sequence.layer", "register_all_to_all_group",
                "--sequence-parallel: the Ulysses all-to-all around attention", True),
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "initialize_sequence_parallel",
                "--sequence-parallel: ZeRO reduces and partitions over the sequence-data-parallel group", True),
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_release_sequence_parallel_groups",
                "--sequence-parallel: a second engine in one process with another sequence-parallel size", False),
    PrivateName("deepspeed.runtime.sequence_parallel.ulysses_sp", "TiledMLP",
                "--tiled-mlp: each MLP computed over tiles of positions", True,
                source_has="param.ds_grad_is_ready = False"),
    PrivateName("deepspeed.runtime.zero.stage3",
                "DeepSpeedZeroOptimizer_Stage3.reduce_independent_p_g_buckets_and_remove_grads",
                "--tiled-mlp at ZeRO-3: a weight's gradient is reduced once, summed over its tiles", True,
                source_has='getattr(param, "ds_grad_is_ready", True)'),
    PrivateName("deepspeed.runtime.zero.stage_1_and_2",
                "DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads",
                "--tiled-mlp at ZeRO-1/2: a weight's gradient is reduced once, summed over its tiles", True,
                source_has='getattr(param, "ds_grad_is_ready", True)'),
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_SEQUENCE_PARALLEL_GROUP",
                "--sequence-parallel: a second engine in one process reuses or replaces the groups", True),
    *(PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.__init__",
                  "--sequence-parallel at ZeRO-3: the gradient factor of the engine's averaging path", True,
                  source_has=f"self.{name} = {name}") for name in ("all2all_process_group", "reduce_scatter")),
)


def sequence_parallel_mpu(size: int):
    """DeepSpeed's sequence-parallel unit for `size` ranks a row, its groups created once per process
    (a later engine of another size releases them first): the module
    deepspeed/runtime/sequence_parallel/parallel_state_sp.py (0.19.8), handed as `mpu` to zero.Init and
    deepspeed.initialize. Its groups: ranks [i*size, (i+1)*size) share rows (sequence-parallel rank =
    rank % size, data-parallel rank = rank // size); the sequence-data-parallel group is every rank.
    DeepSpeed recognises it by its `initialize_sequence_parallel` attribute (utils/groups.py): the engine
    then reduces gradients and partitions ZeRO state over the sequence-data-parallel group, divides the
    reduced gradients by world/size (stage_1_and_2.py and stage3.py: `/ float(self.sequence_parallel_size)`),
    and config.py takes the batch's world size as world/size.
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if getattr(mpu, "_SEQUENCE_PARALLEL_GROUP", None) is not None:
        if mpu.get_sequence_parallel_world_size() == size:
            return mpu
        mpu._release_sequence_parallel_groups()
    mpu.initialize_sequence_parallel(size)
    return mpu


def sequence_all_to_all(group):
    """tensor -> tensor: DeepSpeed's differentiable all-to-all over dimension 0 within `group` (dim 0's
    length must be the group's size; its backward is the same exchange).

    Matches deepspeed/sequence/layer.py (0.19.8): `_dim_zero_all_to_all(group, input)`, the exchange
    UlyssesSPAttentionHF uses (a registered custom op, so torch.compile keeps its backward), which resolves
    the group by name from a registry that `register_all_to_all_group` fills, outside any compiled region.
    """
    from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

    register_all_to_all_group(group)
    return functools.partial(_dim_zero_all_to_all, group)


def tiled_mlp(mlp, x, tiles: int):
    """--tiled-mlp: `mlp.compute(x)` over `tiles` stretches of x's positions with DeepSpeed's TiledMLP
    (modeling/model.py MLP calls it with sizes.mlp_tiles).

    Matches deepspeed/runtime/sequence_parallel/ulysses_sp.py (0.19.8) `TiledMLP.apply(fn, self, x, shards,
    compute_params)`: forward runs `fn(self, tile)` on `torch.chunk(x, shards, dim=-2)` under no_grad and keeps
    only x; backward recomputes each tile with grad and back-propagates it, with `ds_grad_is_ready` False on
    every compute_param until the last tile, so that ZeRO's gradient hooks (stage_1_and_2.py and stage3.py
    `reduce_independent_p_g_buckets_and_remove_grads`) reduce each weight's gradient once, summed over the
    tiles. At ZeRO-3 the weights are gathered by their own modules' forward hooks, in both passes (the
    sub-modules are called, not their weights read). Measured on a CPU: the output and the input's gradient are
    bit-identical to the untiled MLP's, the weights' gradients equal to rounding (summed tile by tile;
    tests/test_tiled_mlp.py).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    return TiledMLP.apply(_mlp_compute, mlp, x, tiles, list(mlp.parameters()))


def _mlp_compute(mlp, x):
    return mlp.compute(x)


def sequence_parallel_gradient_factor(engine, size: int) -> float:
    """What each rank's loss share's gradient must be multiplied by so that the gradient the optimizer
    gets is the mean, over the data-parallel groups, of each row group's gradient (the sum over its `size`
    ranks), for the engine DeepSpeed built.

    DeepSpeed 0.19.8 sums the gradients over every rank (the sequence-data-parallel group) and divides by:
    world/size in ZeRO-0 (engine.py _reduce_non_expert_gradients), ZeRO-1/2 (stage_1_and_2.py, both
    allreduce_bucket and the reduce-scatter path: `/ float(self.sequence_parallel_size)`) and ZeRO-3's
    contiguous all-reduce path (stage3.py __avg_scatter_contiguous_grads); but by the whole world in
    ZeRO-3's reduce-scatter path (stage3.py __avg_scatter_grads -> coalesced_collectives.py
    reduce_scatter_coalesced, `div_(world_sz)`, no sequence-parallel correction). ZeRO-3 takes the latter
    for every bucket when zero_optimization.reduce_scatter is on (its default), the former only for buckets
    within reduce_bucket_size when it is off: a mix no single factor corrects, so it is refused, as is
    ZeRO-3's quantized-gradient all-to-all (not read). Measured on 2 CPU ranks: without the factor ZeRO-3's
    gradients came out exactly 1/2 at size 2 (tests/test_sequence_parallel.py).
    """
    if engine.zero_optimization_stage() != 3:
        return 1.0
    if getattr(engine.optimizer, "all2all_process_group", None) is not None:
        raise ValueError("sequence parallelism with ZeRO-3's quantized gradients (zero_quantized_gradients) is not"
                         " supported: DeepSpeed's averaging on that path was not verified")
    if not getattr(engine.optimizer, "reduce_scatter", True):
        raise ValueError("sequence parallelism at ZeRO-3 needs zero_optimization.reduce_scatter on (its default):"
                         " with it off DeepSpeed 0.19.8 averages some buckets over world/N ranks, others over all")
    return float(size)
