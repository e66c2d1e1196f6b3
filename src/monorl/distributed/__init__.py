"""Several GPUs and nodes: torchrun, one process per GPU.

    world.py       which rank this is, the process group (with a collective timeout), the few collectives the
                   loop needs; one process outside torchrun (`SINGLE`: no process group, nothing changes)
    fsdp.py        FSDP2 on the trainer's policy: one unit per transformer block and the root

The run-level pieces on several ranks live with the run: sharded checkpoints `run/checkpoints/sharded.py`,
restarts `run/elastic.py`, `--nproc` `run/launch.py`; the placement, the weight broadcast and the rollout
transfer `rl/ranks/`.

Where the rest of monorl meets it: the trainer trains its share of the step (`train/trainer.py`), rollouts
generate theirs (`rl/rollouts.py`), the weight sync all-gathers the shards in buckets (`distributed/weight_sync.py`).
"""
