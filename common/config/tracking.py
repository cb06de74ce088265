"""Where the drafters' learning curves go: TensorBoard, Weights & Biases, MLflow (any subset), besides the
record every drafter always writes (`<dir>/drafter-<j>.jsonl`, which `dflash-ring report` draws).

Not part of the ring's fingerprint: processes of one run need not agree on where curves go. Import-light
(no tracker library): the libraries come with the `tracking` extra and are imported by the drafter only for
the backends it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ring.common.config.paths import OutputDirectory

Backend = Literal["tensorboard", "wandb", "mlflow"]


@dataclass
class TrackingConfig:
    # Any subset; empty: only the run's record files. `dflash-ring run`'s embedded default turns on tensorboard.
    backends: list[Backend] = field(default_factory=list)
    # Record files, TensorBoard event files (<dir>/tensorboard/drafter-<j>/), W&B's offline runs (<dir>/wandb/)
    # and the default MLflow store (<dir>/mlruns). Empty: <the run's directory>/tracking, the run's directory
    # being the one that holds train.checkpoint_dir (runs/<name>/ beside runs/<name>/checkpoints).
    dir: OutputDirectory = ""
    # W&B project and MLflow experiment.
    project: str = "dflash-ring"
    # The tracker run's name (W&B group and display names, MLflow run names); empty: run.name.
    run_name: str = ""
    tags: list[str] = field(default_factory=list)
    # "offline": W&B writes its run files under <dir>/wandb and nothing leaves the host (`wandb sync` uploads
    # them later); "online" needs an API key (`wandb login` or WANDB_API_KEY).
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_entity: str = ""
    # Empty: a local file store, <dir>/mlruns (`mlflow ui --backend-store-uri <dir>/mlruns`); else a tracking
    # server's http(s):// URI or any store URI MLflow takes.
    mlflow_tracking_uri: str = ""

    def __post_init__(self) -> None:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends = {self.backends}: each backend at most once")
