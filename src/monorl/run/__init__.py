"""The run: its parts built from the resolved config (`parts`), driven per placement (`colocated`, `trainer_ranks`,
`generator_ranks`); start-up, run directory, checkpoints, summary."""
