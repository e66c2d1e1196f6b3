"""Several GPUs and nodes: torchrun, one process per GPU.

    world.py       which rank this is, the process group (with a collective timeout), the few collectives the
                   loop needs; one process outside torchrun (`SINGLE`: no process group, nothing changes)
    fsdp.py        FSDP2 on the trainer's policy: one unit per transformer block and the root
    checkpoint.py  sharded training checkpoints (DCP), resumable on another rank count; the HF export
    elastic.py     a job torchrun restarted resumes from its last complete checkpoint
    launch.py      `monorl train --nproc N`: re-exec through torch.distributed.run
    placement.py   colocated, or disaggregated (`placement.generator_ranks G`): which ranks generate, which
                   train, and their process groups
    weight_broadcast.py  disaggregated: each update from the trainers' shards into the generators' copies, in place
    rollout_transfer.py  disaggregated: each generator's scored groups to every trainer

Where the rest of monorl meets it: the trainer trains its share of the step (`train/trainer.py`), rollouts
generate theirs (`rl/rollouts.py`), the weight sync all-gathers the shards in buckets (`distributed/weight_sync.py`).
"""
