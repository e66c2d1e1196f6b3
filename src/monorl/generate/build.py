"""The one way a run's generator is built, for training (`monorl.run.grpo.GRPORun`) and for `monorl generate` /
`monorl eval` (`monorl.eval.run.open_generator`): this rank's tensor-parallel group, the copy of the policy, and its
batch-invariant conversion, each as `cfg` (resolved: `monorl.assembly.resolve_config`) says."""

from __future__ import annotations

from typing import Protocol

from monorl.compile import CompileConfig
from monorl.distributed.world import World
from monorl.generate.generator import Generator, GeneratorConfig
from monorl.generate.tensor_parallel import TensorParallel, tensor_parallel_group
from monorl.model.batch_invariant import make_batch_invariant_
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.lora import LoRAConfig, is_lora
from monorl.model.tokenizer import eos_ids


class GeneratorSections(Protocol):
    """The parts of a run's config a generator is built from (`monorl.config.RunConfig` has them)."""

    generator: GeneratorConfig
    lora: LoRAConfig
    batch_invariant: bool | str


def generator_group(cfg: GeneratorSections, world: World) -> TensorParallel:
    """This rank's group of `generator.tensor_parallel_size` ranks sharing one copy (every rank of `world` must call
    it once, before any copy is built: creating groups is a collective); batch-invariant runs sum row-parallel
    partials in a fixed order."""
    return tensor_parallel_group(world.rank, world.size, cfg.generator.tensor_parallel_size,
                                 fixed_order=bool(cfg.batch_invariant))


def lora_kept_separate(cfg: GeneratorSections) -> bool:
    """Whether a LoRA run's generator keeps the adapters as separate matmuls over the policy's shared frozen base
    (batch-invariant mode, or `generator.merge_lora` off) rather than merging them into a copy of its own."""
    return bool(cfg.batch_invariant) or not cfg.generator.merge_lora


def build_generator(policy: DecoderForCausalLM, cfg: GeneratorSections, tokenizer: object, tp: TensorParallel,
                    compile: CompileConfig, allocate_kv: bool = True) -> Generator:
    """The generator's own copy of `policy` (this rank's shard of it with tensor parallelism). In batch-invariant mode
    the copy is converted (`make_batch_invariant_`) and a LoRA policy's adapters stay separate matmuls, unmerged (the
    bitwise guarantee is for those), over the policy's own frozen base; otherwise adapters are merged into the copy
    at every sync, unless `generator.merge_lora` is off (separate, the base shared, as in batch-invariant mode)."""
    lora = cfg.lora if lora_kept_separate(cfg) and is_lora(policy) else None
    gen = Generator(policy, cfg.generator, tokenizer=tokenizer, compile=compile, allocate_kv=allocate_kv,
                    eos_token_ids=eos_ids(tokenizer, policy.config), lora=lora, tp=tp)
    if cfg.batch_invariant:  # converted once (the KL reference inherits the policy's conversion)
        make_batch_invariant_(gen.model)
    return gen
