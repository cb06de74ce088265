"""The drafter-trainer process and its training: the ring input, the objective and loss, the optimizer step,
checkpoints, replicas, warm start and the account of each item."""
