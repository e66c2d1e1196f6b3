"""Which rank does what (`placement`) and what travels between generator and trainer ranks (`weight_broadcast`,
`rollout_transfer`)."""
