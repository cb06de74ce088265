"""Offline acceptance eval: speculative decoding is lossless, and tau/histogram are counted right."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_ring.cli import main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.common.refusal import Refusal
from dflash_ring.consumer.evaluation import evaluate
from dflash_ring.consumer.evaluation.evaluate import (
    AcceptanceReport,
    Generation,
    drafter_draft_fn,
    evaluate_drafter,
    speculative_generate,
    summarize,
)
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.modeling.model import Anchors, FrozenTargetHead
from dflash_ring.consumer.families.build import build_drafter
from support import save_eval_target, tiny_qwen3_config

BLOCK, MAX_NEW, LAYER_IDS = 4, 24, [1, 2]
PROMPTS = ([5, 17, 42, 9, 33, 120, 7], [3, 3, 3], list(range(60, 90)))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_eval_target(tmp_path_factory.mktemp("target"), 448)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory):
    torch.manual_seed(1)
    cfg = DrafterConfig(
        num_hidden_layers=2, block_size=BLOCK, loss_gamma=2.0, mask_token_id=447, target_layer_ids=LAYER_IDS
    )
    config = json.loads((target_dir / "config.json").read_text())
    return export_drafter(build_drafter(cfg, config), cfg, config, tmp_path_factory.mktemp("d") / "drafter")


@pytest.fixture(scope="module")
def drafter(drafter_dir):
    return load_drafter(drafter_dir, dtype=torch.float32).eval()


def head_of(target: Qwen3ForCausalLM) -> FrozenTargetHead:
    return FrozenTargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)


@torch.no_grad()
def plain_greedy(target: Qwen3ForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: the whole sequence re-run for every token, no cache, no drafts."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def generate(target, prompt, draft, eos=(), max_new=MAX_NEW) -> Generation:
    return speculative_generate(
        target, prompt, draft, block_size=BLOCK, target_layer_ids=LAYER_IDS, eos_token_ids=eos, max_new_tokens=max_new
    )


def oracle(prompt: list[int], continuation: list[int]):
    """A drafter that is perfect by construction: it proposes the target's own greedy tokens."""

    def draft(committed: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        done = committed.shape[0] - len(prompt)
        return torch.tensor(continuation[done : done + BLOCK - 1])

    return draft


@pytest.mark.parametrize("prompt", PROMPTS)
def test_drafter_decoding_equals_plain_greedy(target, drafter, prompt):
    got = generate(target, prompt, drafter_draft_fn(drafter, head_of(target)))
    assert got.tokens == plain_greedy(target, prompt, MAX_NEW)
    assert all(0 <= n <= BLOCK - 1 for n in got.accepted)
    # One token from the prefill, then accepted + 1 per round, cut at max_new_tokens.
    assert len(got.tokens) == min(MAX_NEW, 1 + sum(n + 1 for n in got.accepted))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_perfect_drafts_are_all_accepted(target, prompt):
    continuation = plain_greedy(target, prompt, MAX_NEW + BLOCK)
    got = generate(target, prompt, oracle(prompt, continuation))
    assert got.tokens == continuation[:MAX_NEW]
    assert got.accepted == [BLOCK - 1] * -(-(MAX_NEW - 1) // BLOCK)
    assert summarize([got], BLOCK).tau == BLOCK


def test_wrong_drafts_still_give_greedy_output(target):
    prompt = PROMPTS[0]
    continuation = plain_greedy(target, prompt, MAX_NEW + BLOCK)
    right = oracle(prompt, continuation)

    def half_right(committed, context):  # the first draft right, the rest wrong: exactly one accepted
        drafts = right(committed, context).clone()
        drafts[1:] = (drafts[1:] + 1) % 400
        return drafts

    got = generate(target, prompt, half_right)
    assert got.tokens == continuation[:MAX_NEW]
    assert set(got.accepted) == {1}


def test_stops_at_eos_and_keeps_it(target):
    prompt = PROMPTS[2]
    continuation = plain_greedy(target, prompt, MAX_NEW)
    eos = continuation[5]
    got = generate(target, prompt, oracle(prompt, continuation + [0] * BLOCK), eos={eos})
    assert got.tokens == continuation[: continuation.index(eos) + 1]


def test_draft_block_sees_only_the_context_before_its_anchor(drafter, target):
    """Inference drafting equals the training forward for a block anchored mid-sequence."""
    torch.manual_seed(2)
    length, anchor = 20, 11
    context = torch.randn(length, drafter.fc.in_features)
    ids = torch.randint(0, 400, (length,))
    anchors = Anchors(
        positions=torch.tensor([anchor]), cu_anchors=torch.tensor([0, 1]), cu_seqlens=torch.tensor([0, length])
    )
    with torch.no_grad():
        trained = drafter(context, ids, anchors, head_of(target))[0]
        inferred = drafter.draft_block(context[:anchor], ids[: anchor + 1], head_of(target))
    torch.testing.assert_close(inferred, trained)


def test_summary_counts():
    report = summarize(
        [Generation(tokens=[1] * 9, accepted=[0, 3, 1]), Generation(tokens=[2], accepted=[])], block_size=BLOCK
    )
    assert report.accepted_histogram == [1, 1, 0, 1]
    assert sum(report.accepted_histogram) == report.rounds == 3
    assert report.tau_per_prompt == [pytest.approx(7 / 3), None]
    assert report.tau == pytest.approx(7 / 3)
    assert report.tokens_generated == 10


def test_evaluate_drafter_on_a_chat_file_and_cli(target_dir, drafter_dir, tmp_path, capsys):
    data = tmp_path / "heldout.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4"}]},
        {"prompt": "Repeat: red cat.", "response": "red cat"},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    threads = torch.get_num_threads()
    report = evaluate_drafter(drafter_dir, target_dir, data, max_new_tokens=12, limit=2)
    assert torch.get_num_threads() == threads  # one thread while it ran (the default), the caller's after
    assert evaluate_drafter(drafter_dir, target_dir, data, max_new_tokens=12, limit=2, cpu_threads=None) == report
    assert isinstance(report, AcceptanceReport)
    assert report.num_prompts == 2 and report.block_size == BLOCK
    assert sum(report.accepted_histogram) == report.rounds > 0
    assert 1 <= report.tau <= BLOCK
    assert report.tokens_generated <= 2 * 12

    args = ["eval", "--drafter", str(drafter_dir), "--target", str(target_dir), "--data", str(data)]
    assert main([*args, "--max-new-tokens", "12", "--limit", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(asdict(report)))
    assert main([*args, "--max-new-tokens", "4", "--limit", "1", "--threads", "2"]) == 0
    assert "tau" in capsys.readouterr().out


TQDM_BAR = re.compile(r"\| \d+/\d+ \[[^]]*\]$")  # transformers' weight-loading bars: not messages
CHATS = [
    {"messages": [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4"}]},
    {"prompt": "Repeat: red cat.", "response": "red cat"},
]


def _narrower_drafter(tmp_path, drafter_dir) -> tuple[object, str]:
    """A drafter exported for a target of width 32, evaluated against the width-64 target."""
    cfg = DrafterConfig(
        num_hidden_layers=1, block_size=BLOCK, loss_gamma=2.0, mask_token_id=447, target_layer_ids=LAYER_IDS
    )
    other = tiny_qwen3_config(hidden_size=32, head_dim=8, vocab_size=448)
    exported = export_drafter(build_drafter(cfg, other), cfg, other, tmp_path / "narrow")
    return exported, "".join(json.dumps(r) + "\n" for r in CHATS)


def _a_row_not_json(tmp_path, drafter_dir) -> tuple[object, str]:
    """The fixture's drafter, its data's second row not JSON."""
    return drafter_dir, json.dumps(CHATS[0]) + "\n{not json\n"


@pytest.mark.parametrize(
    "setup, says",
    [
        (_narrower_drafter, "drafter reads target layers [1, 2] (64 channels) but the target has 4 layers of width 64"),
        (_a_row_not_json, "chat.jsonl, line 2: invalid JSON"),
    ],
    ids=["drafter-of-another-width", "data-row-not-json"],
)
def test_an_input_eval_refuses_is_one_line_exit_2(target_dir, drafter_dir, tmp_path, capsys, setup, says):
    """The input is the user's (common/refusal.py): cli.main's boundary prints it as the one error line, exit 2."""
    drafter, rows = setup(tmp_path, drafter_dir)
    (tmp_path / "chat.jsonl").write_text(rows)
    args = ["eval", "--drafter", str(drafter), "--target", str(target_dir), "--data", str(tmp_path / "chat.jsonl")]
    assert main(args) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.strip() and not TQDM_BAR.search(ln)]
    assert line.startswith("dflash-ring eval: error: ") and says in line, err


def _target_template(text: str | None):
    """A copy of the target whose chat_template.jinja holds `text` (None: no template at all)."""

    def change(tmp_path, target_dir, drafter_dir) -> dict:
        copy = tmp_path / "target"
        shutil.copytree(target_dir, copy)
        if text is None:
            (copy / "chat_template.jinja").unlink()
        else:
            (copy / "chat_template.jinja").write_text(text)
        return {"--target": copy}

    return change


def _drafter_config(text: str):
    def change(tmp_path, target_dir, drafter_dir) -> dict:
        copy = tmp_path / "drafter"
        shutil.copytree(drafter_dir, copy)
        (copy / "config.json").write_text(text)
        return {"--drafter": copy}

    return change


def _drafter_weights_as(dtype: str):
    def change(tmp_path, target_dir, drafter_dir) -> dict:
        from safetensors.torch import load_file, save_file

        copy = tmp_path / "drafter"
        shutil.copytree(drafter_dir, copy)
        state = load_file(copy / "model.safetensors")
        save_file({k: v.to(getattr(torch, dtype)) for k, v in state.items()}, copy / "model.safetensors")
        return {"--drafter": copy}

    return change


def _data(text: str):
    def change(tmp_path, target_dir, drafter_dir) -> dict:
        (tmp_path / "chat.jsonl").write_text(text)
        return {}

    return change


def _foreign_tokenizer(tmp_path, target_dir, drafter_dir) -> dict:
    """A copy of the target with another model's tokenizer files, and a row of words it has ids past 448 for."""
    from support import foreign_tokenizer

    tokenizer, words = foreign_tokenizer(tmp_path / "other")
    copy = tmp_path / "target"
    shutil.copytree(target_dir, copy)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer / f, copy / f)
    row = {"messages": [{"role": "user", "content": " ".join(words[:40])}, {"role": "assistant", "content": "x"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n")
    return {"--target": copy}


def _a_fifo(tmp_path, target_dir, drafter_dir) -> dict:
    os.mkfifo(tmp_path / "pipe.jsonl")
    return {"--data": tmp_path / "pipe.jsonl"}


# Inputs that were a traceback (a template that does not parse or is absent, a drafter config.json that is not an
# object), a meaningless error (a prompt of no tokens reached the model; a missing target "must be a repo id"), a
# hang (a FIFO read to its end) or a report over no prompt at all (an empty data file, exit 0).
EVAL_INPUTS = {
    "data-empty": (_data(""), "chat.jsonl has no rows"),
    "data-blank-lines": (_data("\n\n  \n"), "chat.jsonl has no rows"),
    "data-a-fifo": (_a_fifo, "pipe.jsonl is not a regular file"),
    "template-does-not-parse": (_target_template("{% for %}"), "line 1: the target's chat template failed"),
    "template-raises": (_target_template("{{ raise_exception('no') }}"), "chat template failed (TemplateError: no)"),
    "template-absent": (_target_template(None), "has no chat template"),
    "template-renders-nothing": (_target_template("{{ '' }}"), "line 1: the target's chat template renders its"),
    "drafter-config-an-array": (_drafter_config("[1]"), "config.json is not a JSON object (got list)"),
    "drafter-config-too-deep": (_drafter_config("[" * 100_000 + "]" * 100_000), "is not a JSON config"),
    "target-missing": (lambda tmp_path, t, d: {"--target": tmp_path / "nope"}, "nope: no config.json there"),
    "tokenizer-of-another-model": (_foreign_tokenizer, "past the 448 embedding rows of the target"),
    "drafter-weights-int8": (_drafter_weights_as("int8"), "is stored as torch.int8, not float16"),
    "drafter-weights-float8": (_drafter_weights_as("float8_e4m3fn"), "is stored as torch.float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(EVAL_INPUTS))
def test_eval_inputs_are_refused_in_one_line(target_dir, drafter_dir, tmp_path, capsys, case):
    change, says = EVAL_INPUTS[case]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    paths = {"--drafter": drafter_dir, "--target": target_dir, "--data": tmp_path / "chat.jsonl"}
    paths.update(change(tmp_path, target_dir, drafter_dir))
    assert main(["eval", *(str(x) for kv in paths.items() for x in kv), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.strip() and not TQDM_BAR.search(ln)]
    assert line.startswith("dflash-ring eval: error: ") and says in line, err


def test_a_bug_inside_eval_keeps_its_traceback(target_dir, drafter_dir, tmp_path, monkeypatch):
    """A plain ValueError inside evaluation is a bug, not a verdict on the input: cli.main lets it through (its
    traceback), where a broad catch around the command would print it as a misleading one-line error, exit 2."""

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(evaluate, "check_compatible", broken)
    (tmp_path / "chat.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    args = ["eval", "--drafter", str(drafter_dir), "--target", str(target_dir), "--data", str(tmp_path / "chat.jsonl")]
    with pytest.raises(ValueError, match="^boom$") as e:
        main(args)
    assert not isinstance(e.value, Refusal)
